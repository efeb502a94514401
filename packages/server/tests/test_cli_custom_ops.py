"""``engine plugins list`` ends with what each custom op is built from."""

from __future__ import annotations

import json
from pathlib import Path

from engine.testing.test_plugins import run_engine_cli


def _op_lines(stdout: str) -> list[str]:
    """The line of each op (its candidates, indented further, left out)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("custom ops on cpu  ("))
    ops = [line for line in lines[start + 1:] if line.startswith("  ") and
           not line.startswith("    ")]
    assert [line.split()[0] for line in ops] == ["fused_moe", "gelu_and_mul", "rms_norm",
                                                 "rotary_embedding", "silu_and_mul"]
    return ops


def test_list_shows_every_op_and_why(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "list"], test_plugins_dir)
    assert result.returncode == 0, result.stderr
    # engine-kernels (installed with engine-server) registers all five, with a CPU path
    # (C++) each: on this CPU they are used, and the built-ins (references) are candidates.
    assert all(" = engine.kernels.ops:" in line and "(engine-kernels 0.1.0)" in line
               and "[default: the only implementation with a cpu path]" in line
               for line in _op_lines(result.stdout))
    assert result.stdout.count("(engine-core 0.1.0)  (priority 0; not eligible: it has no "
                               "cpu path of its own") == 5
    forced = run_engine_cli(["plugins", "list", "--custom-ops", "all"], test_plugins_dir)
    assert all("engine.kernels.ops:" in line and "[--custom-ops: all]" in line
               for line in _op_lines(forced.stdout))
    none = run_engine_cli(["plugins", "list", "--custom-ops", "none"], test_plugins_dir)
    assert all("built-in engine.core.model_executor.layers.builtin_ops:" in line
               and "[--custom-ops: none]" in line for line in _op_lines(none.stdout))
    # The allowlist governs third parties: engine-kernels' ops stay under ENGINE_PLUGINS=none.
    kept = run_engine_cli(["plugins", "list"], test_plugins_dir, env={"ENGINE_PLUGINS": "none"})
    assert _op_lines(kept.stdout) == _op_lines(result.stdout)


def test_bad_custom_ops_items_fail_listing_the_ops(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "list", "--json", "--custom-ops", "+rms_norm=acme"],
                            test_plugins_dir)
    assert result.returncode == 2
    assert ("no allowed distribution 'acme' provides 'rms_norm'; its implementations come "
            "from engine-core, engine-kernels") in result.stderr
    result = run_engine_cli(["plugins", "list", "--custom-ops=-rms"], test_plugins_dir)
    assert result.returncode == 2
    assert ("ops: fused_moe, gelu_and_mul, rms_norm, rotary_embedding, silu_and_mul"
            in result.stderr)
    ok = run_engine_cli(["plugins", "list", "--json", "--custom-ops=none,-rms_norm"],
                        test_plugins_dir)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)  # the rows are unchanged in shape
