"""engine.testing: pytest plugin (``pytest -p engine.testing``), fixtures, contract suites.

Also :func:`plugin_context` / :func:`plugin_options` (:mod:`engine.testing.contexts`): the
context the engine would build a plugin with, options validated, for unit tests.
"""

from engine.testing.contexts import plugin_context, plugin_options
from engine.testing.fixtures import (
    deprecate_hook,
    fault_plugins_dir,
    hub_offline,
    plugins_on_path,
    test_plugins_dir,
    tiny_llama_checkpoint,
)

__all__ = [
    "deprecate_hook",
    "fault_plugins_dir",
    "hub_offline",
    "plugin_context",
    "plugin_options",
    "plugins_on_path",
    "test_plugins_dir",
    "tiny_llama_checkpoint",
]
