"""benchmarks/kernels_gpu.py: it imports, parses its arguments, and refuses a host without CUDA."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels_gpu.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernels_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_it_parses_its_arguments() -> None:
    args = load().build_parser().parse_args(
        ["--skip-e2e", "--models", "100m", "--batch-sizes", "1,8", "--iters", "5"])
    assert args.skip_e2e and args.models == "100m" and args.batch_sizes == "1,8"
    assert args.iters == 5 and args.output_len == 128 and not args.skip_transformers


def test_the_1b_model_is_one_billion_class() -> None:
    bench = load()
    nbytes = bench.weight_bytes(bench.LLAMA_1B)  # on the meta device: nothing allocated
    assert 2.2e9 < nbytes < 2.6e9  # ~1.2B bfloat16 parameters, the tied LM head read once


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without a GPU")
def test_without_cuda_it_exits_saying_why() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--skip-e2e"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    assert "kernels_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False" in result.stderr
