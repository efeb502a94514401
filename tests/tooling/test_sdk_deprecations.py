"""Deprecations in the gate: noted, listed in the docs from the code, removed on time."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from sdkapi import deprecations_page
from sdkapi.gate import run_gate
from sdkapi.layout import Layout
from sdkapi.snapshot import ExtractionError, extract

Edit = Callable[[str, str, str], None]

LOG = '    def log(self) -> None:\n        """Emit a periodic summary.'
MARKED = ('    @deprecated_hook(since="{since}", replacement="record")\n'
          '    def log(self) -> None:\n        """Emit a periodic summary.')
NOTE = ("        .. deprecated:: {since} Summarise in ``record`` instead.\n"
        "        \"\"\"\n\n    def log_engine_initialized")


def deprecate_log(repo: Layout, edit: Edit, versions: Any, *, note: bool = True) -> None:
    """Mark ``StatLogger.log`` as a deprecated hook in the next minor of the scratch SDK."""
    repo.write_version(versions.next_minor)
    edit("stat_logger.py", "from engine.sdk.context import PluginContext",
         "from engine.sdk.context import PluginContext\n"
         "from engine.sdk.deprecation import deprecated_hook")
    edit("stat_logger.py", LOG, MARKED.format(since=versions.minor))
    plain = '        """\n\n    def log_engine_initialized'
    edit("stat_logger.py", 'Default: no-op."""\n\n    def log_engine_initialized',
         "Default: no-op.\n\n" + (NOTE.format(since=versions.minor) if note else plain))


def regenerate_page(repo: Layout) -> None:
    version = repo.read_version()
    snapshot = extract(repo.sdk_src, version)
    deprecations_page.write_table(repo.deprecations_page, deprecations_page.render_table(
        snapshot.deprecations(), int(version.split(".")[0])))


def test_a_new_deprecation_must_be_noted_and_listed(
    repo: Layout, edit: Edit, versions: Any
) -> None:
    deprecate_log(repo, edit, versions, note=False)
    result = run_gate(repo)
    assert result.problems == [
        f"engine.sdk.stat_logger.StatLogger.log: deprecated since {versions.minor}; add "
        f"`.. deprecated:: {versions.minor} <what to use instead>` to its docstring",
        "docs/plugins/deprecations.md does not list the deprecations in the code: run "
        "`python scripts/sdk_api.py deprecations --write` and commit the page"]


def test_a_noted_and_listed_deprecation_passes(repo: Layout, edit: Edit, versions: Any) -> None:
    deprecate_log(repo, edit, versions)
    regenerate_page(repo)
    result = run_gate(repo)
    assert result.ok, result.problems
    [change] = result.of_kind("deprecation")
    assert change.path == "engine.sdk.stat_logger.StatLogger.log"
    page = repo.deprecations_page.read_text()
    assert (f"| {versions.minor} | `engine.sdk.stat_logger.StatLogger.log` (hook) | record | "
            f"{versions.major + 1}.0 |") in page
    assert f"No deprecations in {versions.major}.x yet." not in page


def test_the_docs_table_equals_what_the_sdk_registers_at_run_time(
    repo: Layout, edit: Edit, versions: Any
) -> None:
    deprecate_log(repo, edit, versions)
    code = ("import importlib, json, pkgutil, sys; sys.path.insert(0, sys.argv[1]); "
            "import engine.sdk; from engine.sdk import deprecation; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages("
            "engine.sdk.__path__, 'engine.sdk.')]; "
            "print(json.dumps([[d.target, d.kind, d.since, d.replacement, d.removed_in] "
            "for d in deprecation.registered()]))")
    run = subprocess.run([sys.executable, "-c", code, str(repo.sdk_src)], capture_output=True,
                         text=True, check=True)
    runtime = json.loads(run.stdout)
    static = [[d["target"], d["kind"], d["since"], d["replacement"], d["removed_in"]]
              for d in extract(repo.sdk_src, versions.next_minor).deprecations()]
    assert runtime == static == [["engine.sdk.stat_logger.StatLogger.log", "hook",
                                  versions.minor, "record", f"{versions.major + 1}.0"]]


def test_a_new_deprecation_is_dated_with_the_release_that_ships_it(
    repo: Layout, edit: Edit, versions: Any
) -> None:
    deprecate_log(repo, edit, versions)
    released = versions.current.rsplit(".", 1)[0]
    edit("stat_logger.py", f'since="{versions.minor}"', f'since="{released}"')
    edit("stat_logger.py", f".. deprecated:: {versions.minor}", f".. deprecated:: {released}")
    regenerate_page(repo)
    assert run_gate(repo).problems == [
        f"engine.sdk.stat_logger.StatLogger.log: a new deprecation must say since="
        f"\"{versions.minor}\" (the release that ships it), not '{released}'"]


def test_removal_of_a_deprecated_feature_in_the_next_major_passes(
    repo: Layout, edit: Edit, versions: Any
) -> None:
    deprecate_log(repo, edit, versions)
    regenerate_page(repo)
    (repo.api_dir / f"{versions.next_minor}.json").write_text(
        extract(repo.sdk_src, versions.next_minor).dumps())  # released with the deprecation
    repo.write_version(versions.next_major)
    assert run_gate(repo).problems == [
        f"engine.sdk.stat_logger.StatLogger.log was to be removed in {versions.major + 1}.0 and "
        f"SDK {versions.next_major} still has it: remove it, or move removed_in to a later major"]
    path = repo.sdk_src / "engine" / "sdk" / "stat_logger.py"
    text = path.read_text()
    start = text.index('    @deprecated_hook(since=')
    path.write_text(text[:start] + text[text.index("    def log_engine_initialized"):])
    deprecations_page.write_table(repo.deprecations_page,
                                  deprecations_page.render_table([], versions.major + 1))
    result = run_gate(repo)
    assert result.ok, result.problems
    assert any(note.startswith("break accepted by the major bump: "
                               "engine.sdk.stat_logger.StatLogger.log") for note in result.notes)


def test_markers_must_use_literal_arguments(repo: Layout, edit: Edit, versions: Any) -> None:
    deprecate_log(repo, edit, versions)
    edit("stat_logger.py", f'since="{versions.minor}"', "since=SINCE")
    with pytest.raises(ExtractionError, match="write deprecation markers with literal arguments"):
        extract(repo.sdk_src, versions.next_minor)
