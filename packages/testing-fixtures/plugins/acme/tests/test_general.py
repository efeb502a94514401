"""acme_register: idempotent, and run by the engine once per process (when allowed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from acme_engine_plugins.general import register

# General plugins run once per process: a fresh interpreter sees the first engine start.
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import acme_engine_plugins.general as general

    calls = []
    original = general.register
    def counting():
        calls.append(1)
        original()
    general.register = counting  # the engine imports the entry point's value after this

    from engine.core import LLM

    def start(**kwargs):
        with LLM(sys.argv[1], dtype="float32", num_kv_blocks=16, in_process=True, **kwargs):
            pass
        return len(calls)

    print(json.dumps([start(plugins="none"), start(), start()]))
""")


def test_register_is_idempotent_and_defines_the_ops() -> None:
    register()
    register()  # a second call in the same process is harmless
    x, residual, weight = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    y, new_residual = torch.ops.acme.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(y, torch.ops.acme.rms_norm(x + residual, weight, 1e-6))


def test_the_engine_runs_it_once_per_process_only_when_allowed(tiny_llama: Path) -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # ENGINE_PLUGINS=none: not run; the first engine that allows it: run; the next: not again
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0, 1, 1]
