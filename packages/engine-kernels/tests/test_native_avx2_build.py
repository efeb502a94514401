"""The CPU kernels' AVX2 build (what a CPU without AVX-512 gets) passes the kernel tests too.

The machines the engine runs on differ: some have AVX-512 (and avx512_bf16), some only AVX2.
On an AVX-512 machine this builds the kernels for ``-march=haswell`` (AVX2 and FMA, the
``ENGINE_CPU_KERNELS_MARCH`` override), has torch run its AVX2 code too
(``ATEN_CPU_CAPABILITY=avx2``: oneDNN without bfloat16, the int4 layout in tiles of 32 rows)
and runs the kernel test modules against that build in a subprocess. On an AVX2-only machine
the ordinary run already is the AVX2 run. Likewise on an AMX machine the build for
``-march=cooperlake`` (avx512_bf16 without AMX: bfloat16 on the panels, not the tiles).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels.cpu.native import native_kernels
from engine.sdk import native as machine

TESTS = Path(__file__).parent
CORE_TESTS = TESTS.parent.parent / "engine-core" / "tests"
MODULES = ["test_attention_backends_cpu.py", "test_cpu_ops.py", "test_gelu_and_mul_cpu.py",
           "test_gguf_dequant_native.py", "test_packed_matmul.py", "test_fused_moe_cpu.py",
           *(str(CORE_TESTS / name) for name in (
               "test_linear_kernels.py", "test_quantization_gguf.py", "test_step_graph.py"))]
FLAGS = set(machine.cpu_flags().split())
# What the AVX2 build must report, checked before its tests run: float32 only (its small
# and packed products; float32 weights of bfloat16 values packed as bfloat16), torch's int4
# tiles of 32 rows.
CHECK = """
import torch
from engine.kernels.cpu import native
from engine.kernels.gguf.kernels import int4pack_block
k = native.load()
assert k.small_matmul_dtypes == {torch.float32}, k.small_matmul_dtypes
assert k.packed_matmul_dtypes == {torch.float32}, k.packed_matmul_dtypes
assert k.packs_float32_as_bfloat16
assert int4pack_block() == 32, int4pack_block()
"""


# What the build without AMX must report: bfloat16 on the avx512_bf16 panels.
CHECK_NO_AMX = """
import torch
from engine.kernels.cpu import native
k = native.load()
assert torch.bfloat16 in k.packed_matmul_dtypes, k.packed_matmul_dtypes
assert not k.amx_bfloat16
"""


def run_kernel_tests(env: dict[str, str], check: str, modules: list[str]) -> None:
    """Run ``check`` then the test ``modules`` in subprocesses with ``env``; both must pass."""
    result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "engine.testing", "-p", "no:cacheprovider",
         "-q", *modules], cwd=TESTS, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.skipif(native_kernels() is None, reason="the CPU kernels cannot be built here")
@pytest.mark.skipif("avx512f" not in FLAGS, reason="this CPU has no AVX-512: the ordinary run "
                    "of the kernel tests is the AVX2 build's")
@pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="this CPU has no AVX2 and FMA")
def test_kernel_tests_pass_on_the_avx2_build() -> None:
    env = {**os.environ, "ENGINE_CPU_KERNELS_MARCH": "haswell", "ATEN_CPU_CAPABILITY": "avx2"}
    run_kernel_tests(env, CHECK, MODULES)


@pytest.mark.slow
@pytest.mark.skipif(native_kernels() is None, reason="the CPU kernels cannot be built here")
@pytest.mark.skipif(not {"amx_bf16", "avx512_bf16"} <= FLAGS, reason="this CPU has no AMX: "
                    "the ordinary run of the kernel tests is the avx512_bf16 (or AVX2) build's")
def test_kernel_tests_pass_on_the_build_without_amx() -> None:
    env = {**os.environ, "ENGINE_CPU_KERNELS_MARCH": "cooperlake"}
    run_kernel_tests(env, CHECK_NO_AMX, ["test_packed_matmul.py", "test_fused_moe_cpu.py", *(
        str(CORE_TESTS / name) for name in ("test_linear_kernels.py", "test_step_graph.py"))])
