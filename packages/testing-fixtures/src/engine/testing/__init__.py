"""engine.testing: pytest plugin (``pytest -p engine.testing``), fixtures, contract suites."""

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
    "plugins_on_path",
    "test_plugins_dir",
    "tiny_llama_checkpoint",
]
