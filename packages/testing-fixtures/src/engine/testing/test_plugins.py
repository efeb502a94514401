"""Install the test plugin distributions for real, into a directory of their own.

The packages in ``packages/testing-fixtures/plugins/`` are built and installed with pip
(``--target``), so their entry points are discovered from real installed metadata, while the
environment running the tests is never changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

#: Where the plugin sources live in a source checkout.
PLUGINS_SOURCE = Path(__file__).resolve().parents[3] / "plugins"

#: Every test plugin distribution, by directory name.
TEST_PLUGIN_DIRS = ("good", "import-error", "not-subclass", "sdk2", "dup-a", "dup-b",
                    "workers", "io", "kvconn", "quant", "structured")

#: ``acme-engine-plugins``: a third-party package with one plugin per extension point and
#: its own test suite (``ACME_SOURCE / "tests"``). Not in ``TEST_PLUGIN_DIRS``: its
#: ``rms_norm`` would replace the op in every other test. Install it with
#: ``install_test_plugins(target, (ACME_DIR,))``.
ACME_DIR = "acme"
ACME_SOURCE = PLUGINS_SOURCE / ACME_DIR


def install_test_plugins(target: Path, dirs: tuple[str, ...] = TEST_PLUGIN_DIRS) -> Path:
    """``pip install --target target`` the given test plugin packages; returns ``target``."""
    if not PLUGINS_SOURCE.is_dir():
        raise FileNotFoundError(
            f"test plugin sources not found at {PLUGINS_SOURCE}; install "
            f"engine-testing-fixtures from a source checkout (pip install -e) to use them"
        )
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
        "--disable-pip-version-check", "--target", str(target),
        *(str(PLUGINS_SOURCE / d) for d in dirs),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return target


def put_on_path(target: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make the plugins installed in ``target`` discoverable and importable in this process.

    Prepends ``target`` to ``sys.path`` and unsets ``ENGINE_PLUGINS`` (every installed plugin
    allowed) until ``monkeypatch`` is undone; returns ``target``.
    """
    monkeypatch.syspath_prepend(str(target))
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    return target


def entry_installer(monkeypatch: pytest.MonkeyPatch, distribution: str, version: str,
                    ) -> Callable[[str, str, type], None]:
    """``add(group, name, cls)``: the engine discovers ``cls`` as an installed entry point.

    As if ``distribution`` (at ``version``) declared ``name = "module:Class"`` in
    ``group``: the entries join what ``importlib.metadata`` finds until ``monkeypatch`` is
    undone. For classes defined in a test or written from a docs page.
    """
    from engine.core.plugins import PluginEntry, _catalog
    from engine.core.plugins._local import plugin_reference

    entries: list[PluginEntry] = []
    discover = _catalog.discover_entries
    monkeypatch.setattr(_catalog, "discover_entries", lambda: [*discover(), *entries])

    def add(group: str, name: str, cls: type) -> None:
        entries.append(PluginEntry(group, name, plugin_reference(cls), distribution, version))

    return add


def env_with_plugins(target: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``os.environ`` whose PYTHONPATH starts with ``target`` (for subprocesses)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH")) if p)
    env.pop("ENGINE_PLUGINS", None)
    env.update(extra or {})
    return env


def run_engine_cli(
    args: list[str], target: Path, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``engine ARGS`` in a subprocess that sees the plugins installed in ``target``."""
    return subprocess.run(
        [sys.executable, "-m", "engine.server.cli", *args],
        env=env_with_plugins(target, env), capture_output=True, text=True, timeout=timeout,
    )
