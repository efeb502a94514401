"""The SDK's API gate bites: each kind of break, an unversioned addition, a stale allowlist.

Every test edits a scratch copy of the SDK (fixture ``repo``) the way a careless change
would, and runs the gate that ``nox -s api_compat`` runs in CI.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdkapi.gate import GateResult, run_gate
from sdkapi.layout import Layout
from sdkapi.snapshot import Snapshot, extract

ROOT = Path(__file__).resolve().parents[2]
Edit = Callable[[str, str, str], None]

NEW_FUNCTION = '''

def shiny() -> int:
    """Something new.{note}"""
    return 1
'''


def added(minor: str) -> str:
    """A versionadded note for a docstring."""
    return f"\n\n    .. versionadded:: {minor}\n    "


def problems(repo: Layout) -> list[str]:
    result = run_gate(repo)
    return result.problems


def only_problem(repo: Layout) -> str:
    [problem] = problems(repo)
    return problem


def test_the_repository_passes_the_gate() -> None:
    result = run_gate(Layout(ROOT))
    assert result.problems == []
    assert result.baseline is not None


def test_the_baseline_is_engine_plugin_sdk_1_0_0_as_released() -> None:
    baseline = Snapshot.load(ROOT / "packages" / "plugin-sdk" / "api" / "1.0.0.json")
    assert baseline.version == "1.0.0"
    # Spot checks of what 1.0 promised: the whole scheduler contract, every group constant.
    assert baseline.objects["engine.sdk.scheduler.SchedulerInterface"]["abstract_methods"] == [
        "add_request", "finish_requests", "get_num_unfinished_requests",
        "has_finished_requests", "make_stats", "reset_prefix_cache", "schedule",
        "update_from_output"]
    assert baseline.objects["engine.sdk.groups.LOGITS_PROCESSORS"]["value"] == \
        "'engine.logits_processors'"
    assert baseline.home("engine.sdk.BatchUpdate") == "engine.sdk.logits_processor.BatchUpdate"
    assert not any(p.startswith("engine.sdk.deprecation") for p in baseline.objects)


def test_removed_method_is_a_break(repo: Layout, edit: Edit) -> None:
    edit("attention.py", "    def describe(self) -> str:", "    def _describe(self) -> str:")
    assert only_problem(repo) == (
        "BREAK engine.sdk.attention.AttentionSpec.describe: function removed from "
        "engine.sdk.attention.AttentionSpec")


def test_removed_export_is_a_break(repo: Layout, edit: Edit) -> None:
    edit("__init__.py", '    "process_dict_updates",\n', "")
    assert only_problem(repo) == "BREAK engine.sdk.process_dict_updates: alias removed"


def test_renamed_parameter_is_a_break(repo: Layout, edit: Edit) -> None:
    edit("attention.py", "    candidates: Sequence[type[AttentionBackend]], spec: AttentionSpec",
         "    backends: Sequence[type[AttentionBackend]], spec: AttentionSpec")
    edit("attention.py", "    for backend in candidates:", "    for backend in backends:")
    assert "BREAK engine.sdk.attention.select_backend(candidates): parameter 'candidates' " \
           "removed" in problems(repo)


def test_new_abstract_method_on_an_existing_abc_is_a_break(
    repo: Layout, edit: Edit, versions: Any
) -> None:
    repo.write_version(versions.next_minor)
    edit("stat_logger.py", "    def log(self) -> None:", "    @abstractmethod\n"
         f"    def flush(self) -> None:\n        \"\"\"New.\n\n        .. versionadded:: "
         f"{versions.minor}\n        \"\"\"\n\n    def log(self) -> None:")
    assert only_problem(repo).startswith(
        "BREAK engine.sdk.stat_logger.StatLogger.flush: is a new abstract method of "
        "engine.sdk.stat_logger.StatLogger: every existing subclass stops loading")


def test_an_optional_method_with_a_default_is_an_addition(
    repo: Layout, edit: Edit, versions: Any
) -> None:
    repo.write_version(versions.next_minor)
    edit("stat_logger.py", "    def log(self) -> None:", "    def flush(self) -> None:\n"
         f"        \"\"\"New; default: no-op.\n\n        .. versionadded:: {versions.minor}\n"
         "        \"\"\"\n\n    def log(self) -> None:")
    result = run_gate(repo)
    assert result.ok, result.problems
    assert "engine.sdk.stat_logger.StatLogger.flush" in {c.path for c in result.of_kind(
        "addition")}


def test_hook_signature_growth_is_a_break(repo: Layout, edit: Edit) -> None:
    edit("stat_logger.py", "iteration_stats: IterationStats | None\n    ) -> None:",
         "iteration_stats: IterationStats | None,\n        verbose: bool = False,\n    ) -> None:")
    assert only_problem(repo).startswith(
        "BREAK engine.sdk.stat_logger.StatLogger.record: hook gained a parameter 'verbose': "
        "the engine would pass it to plugins whose overrides do not accept it")


def test_changed_dataclass_fields_are_breaks(repo: Layout, edit: Edit) -> None:
    edit("attention.py", "    block_size: int\n", "    block_size: str\n")
    edit("attention.py", "    max_model_len: int\n", "    max_model_len: int\n    page_size: int\n")
    found = problems(repo)
    assert "BREAK engine.sdk.attention.AttentionSpec.block_size: type changed from int to str" \
        in found
    assert "BREAK engine.sdk.attention.AttentionContext.__init__: dataclass field 'page_size' " \
           "added without a default: existing calls break" in found


def test_changed_constant_is_a_break(repo: Layout, edit: Edit) -> None:
    edit("groups.py", 'LOGITS_PROCESSORS = "engine.logits_processors"',
         'LOGITS_PROCESSORS = "engine.logits_processor"')
    assert only_problem(repo) == (
        "BREAK engine.sdk.groups.LOGITS_PROCESSORS: value changed from "
        "'engine.logits_processors' to 'engine.logits_processor'")


def test_an_allowlist_entry_with_a_reason_accepts_a_break(repo: Layout, edit: Edit) -> None:
    edit("attention.py", "    def describe(self) -> str:", "    def _describe(self) -> str:")
    with repo.allowlist.open("a") as f:
        f.write("engine.sdk.attention.AttentionSpec.describe  # only used in error messages\n")
    result = run_gate(repo)
    assert result.ok, result.problems
    assert any("only used in error messages" in note for note in result.notes)


def test_allowlist_entries_need_a_reason_and_must_match_a_break(
    repo: Layout, versions: Any
) -> None:
    repo.allowlist.write_text("engine.sdk.attention.AttentionSpec.describe\n")
    assert "needs a reason after '#'" in only_problem(repo)
    repo.allowlist.write_text("engine.sdk.attention.AttentionSpec.describe  # reason\n")
    assert f"matches no breaking change against {versions.current}; remove the entry" in \
        only_problem(repo)


def test_an_addition_needs_a_minor_bump(repo: Layout, edit: Edit, versions: Any) -> None:
    assert problems(repo) == []  # the scratch tree is exactly its release
    edit("support.py", "", NEW_FUNCTION.format(note=added(versions.minor)))
    [problem, *_] = problems(repo)
    assert problem == (f"1 addition(s) or deprecation(s) since {versions.current} need a minor "
                       f"version bump: set __version__ = \"{versions.next_minor}\" in "
                       f"packages/plugin-sdk/src/engine/sdk/_version.py (now {versions.current})")
    repo.write_version(versions.next_patch)  # a patch release may not add either
    assert "need a minor version bump" in problems(repo)[0]
    repo.write_version(versions.next_minor)
    assert problems(repo) == []


def test_an_addition_needs_a_versionadded_note(repo: Layout, edit: Edit, versions: Any) -> None:
    repo.write_version(versions.next_minor)
    edit("support.py", "", NEW_FUNCTION.format(note=""))
    assert only_problem(repo) == (f"engine.sdk.support.shiny: new function; add "
                                  f"`.. versionadded:: {versions.minor}` to its docstring")
    released = versions.current.rsplit(".", 1)[0]
    edit("support.py", '"""Something new."""', f'"""Something new.{added(released)}"""')
    assert f"versionadded:: {versions.minor}" in only_problem(repo)  # it is not in {released}


def test_a_new_parameter_of_a_helper_needs_a_versionchanged_note(
    repo: Layout, edit: Edit, versions: Any
) -> None:
    repo.write_version(versions.next_minor)
    edit("attention.py", "    candidates: Sequence[type[AttentionBackend]], spec: AttentionSpec",
         "    candidates: Sequence[type[AttentionBackend]], spec: AttentionSpec, "
         "strict: bool = False")
    assert only_problem(repo) == (
        f"engine.sdk.attention.select_backend(strict): new parameter 'strict' of "
        f"engine.sdk.attention.select_backend; add `.. versionchanged:: {versions.minor} Added "
        f"``strict``.` to the docstring of engine.sdk.attention.select_backend")
    edit("attention.py", "    \"\"\"\n    reasons: list",
         f"    .. versionchanged:: {versions.minor} Added ``strict``.\n"
         f"    \"\"\"\n    reasons: list")
    assert problems(repo) == []


def test_a_major_bump_accepts_breaks_but_not_removal_without_deprecation(
    repo: Layout, edit: Edit, versions: Any
) -> None:
    repo.write_version(versions.next_major)
    edit("stat_logger.py", "iteration_stats: IterationStats | None\n    ) -> None:",
         "iteration_stats: IterationStats | None,\n        verbose: bool,\n    ) -> None:")
    edit("attention.py", "    def describe(self) -> str:", "    def _describe(self) -> str:")
    result: GateResult = run_gate(repo)
    assert any("break accepted by the major bump: engine.sdk.stat_logger.StatLogger.record"
               in note for note in result.notes)
    [removal] = [p for p in result.problems if p.startswith("BREAK")]
    assert removal.startswith("BREAK engine.sdk.attention.AttentionSpec.describe: function "
                              "removed from engine.sdk.attention.AttentionSpec without a "
                              f"deprecation period: deprecate it in a {versions.major}.x "
                              "release first")


def test_the_cli_exits_1_and_prints_the_break(repo: Layout, edit: Edit) -> None:
    edit("attention.py", "    def describe(self) -> str:", "    def _describe(self) -> str:")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "sdk_api.py"), "--root",
                          str(repo.root), "check"], capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "error: BREAK engine.sdk.attention.AttentionSpec.describe" in run.stdout
    assert "1 break(s)" in run.stdout


def test_snapshots_round_trip_and_ignore_private_moves(repo: Layout) -> None:
    snapshot = extract(repo.sdk_src, repo.read_version())
    assert Snapshot.loads(snapshot.dumps()).objects == snapshot.objects
    # Moving a class between private modules is not an API change: homes are public paths.
    lp = repo.sdk_src / "engine" / "sdk" / "logits_processor"
    (lp / "_batch_update.py").rename(lp / "_updates.py")
    for path in lp.glob("*.py"):
        path.write_text(path.read_text().replace("._batch_update", "._updates"))
    assert problems(repo) == []
