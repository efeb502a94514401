"""The packed product (``NativeKernels.packed_matmul``) and the ``cpu`` kernel's use of it."""

from __future__ import annotations

import platform
import re

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu.linear import CpuLinearKernel
from engine.kernels.cpu.native import native_kernels
from engine.kernels.cpu.native.library import SMALL_MATMUL_ROWS, packed_matmul_size
from engine.sdk import native as machine
from engine.sdk.linear_kernel import LinearKernelConfig
from engine.sdk.native import target_arch

NATIVE = native_kernels()
BUILT = frozenset() if NATIVE is None else NATIVE.packed_matmul_dtypes
pytestmark = pytest.mark.skipif(
    not BUILT, reason="the packed kernel is built for CPUs with AVX-512 or AVX2 and FMA only "
    "(oneDNN elsewhere)")
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(
    dtype not in BUILT, reason=f"no packed {dtype} kernel on this CPU (float32 needs "
    "AVX-512 or AVX2 and FMA, bfloat16 avx512_bf16)")) for dtype in (torch.float32, torch.bfloat16)]
#: The dtype the tests of the kernel's behaviour (not its sums) use: bfloat16 where built.
DTYPE = torch.bfloat16 if torch.bfloat16 in BUILT else torch.float32
needs_bfloat16 = pytest.mark.skipif(torch.bfloat16 not in BUILT,
                                    reason="no packed bfloat16 kernel (avx512_bf16) here")


def layer_with(weight: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def cpu_kernel(weight: torch.Tensor) -> tuple[CpuLinearKernel, torch.nn.Module]:
    dtype = str(weight.dtype).removeprefix("torch.")
    n, k = weight.shape
    kernel = CpuLinearKernel(LinearKernelConfig(
        scheme="unquantized", weight_dtype=dtype, act_dtype=dtype, input_size=k,
        output_size=n, has_bias=True))
    layer = layer_with(weight)
    kernel.process_weights_after_loading(layer)
    return kernel, layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(64, 768), (100, 98), (40, 2), (24, 33)])  # last panel cut
def test_packed_matmul_against_float64(dtype: torch.dtype, n: int, k: int) -> None:
    assert NATIVE is not None
    if dtype == torch.bfloat16 and k % 2:
        pytest.skip("bfloat16 is packed in pairs along K (an odd K is refused, tested below)")
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = NATIVE.pack_matmul_weight(weight)
    assert packed.shape == (packed_matmul_size(n, k),) and packed_matmul_size(n, k) % 32 == 0
    # One block, blocks of equal and unequal rows (AVX-512's blocks of up to 12: 13 = 7 + 6,
    # 25 = 9 + 8 + 8; AVX2's of up to 6: 13 = 5 + 4 + 4), and 300 rows across a pass of
    # 256. n = 100, 40, 24: the last panel cut (AVX2: inside its second tile of 16 columns,
    # or its second tile wholly past n).
    for rows in (4, 12, 13, 25, 300):
        x = torch.randn(rows, k + 6, generator=gen).to(dtype)[:, :k]  # rows k + 6 apart
        whole = torch.full((rows, n + 24), 7.0, dtype=dtype)
        out = whole[:, :n]
        for b in (bias, None):
            NATIVE.packed_matmul(x, packed, n, b, out)
            want = x.double() @ weight.double().T + (0 if b is None else b.double())
            # float32 sums in another order; bfloat16 rounds the result (2 ** -8 relative).
            tol = 1e-5 if dtype == torch.float32 else 2 ** -8
            assert ((out.double() - want).abs() <= tol * want.abs().max()).all(), rows
        assert (whole[:, n:] == 7).all()  # nothing written past the row's end


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [32, 64, 96, 50, 768, 2560])  # 50: K blocks of 32 and a tail
def test_packed_matmul_across_row_counts_and_tails(dtype: torch.dtype, threads: int,
                                                   k: int) -> None:
    """Every row count the loops block differently against a float32 reference.

    With AMX (``amx_bfloat16``) bfloat16 runs on tiles of 16 rows x 32 K values x 16
    columns, blocks of 32 rows: 1, 3, 15 rows pad one tile, 17 and 33 a second or third
    one, 513 crosses passes of 256; N = 40 and 1000 end inside a tile's second half of
    16 columns, 1000 inside its first; K = 50 has a K block of 9 pairs. Elsewhere the same
    shapes cross the panels' row blocks.
    """
    assert NATIVE is not None
    gen = torch.Generator().manual_seed(k * threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (40, 1000):
            weight = torch.randn(n, k, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype)
            packed = NATIVE.pack_matmul_weight(weight)
            for rows in (1, 3, 15, 16, 17, 33, 64, 100, 513):
                x = torch.randn(rows, k + 6, generator=gen).to(dtype)[:, :k]  # rows k + 6 apart
                whole = torch.full((rows, n + 24), 7.0, dtype=dtype)
                out = whole[:, :n]  # rows n + 24 apart
                for b in (bias, None):
                    NATIVE.packed_matmul(x, packed, n, b, out)
                    want = x.float() @ weight.float().T + (0 if b is None else b.float())
                    # float32 sums in another order; bfloat16 rounds the result (2 ** -8).
                    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
                    err = (out.float() - want).abs().max().item()
                    assert err <= tol * want.abs().max().item(), (n, rows, b is None, err)
                assert (whole[:, n:] == 7).all()  # nothing written past the row's end
    finally:
        torch.set_num_threads(previous)


@needs_bfloat16
def test_bfloat16_panels_use_amx_where_the_cpu_has_it() -> None:
    """A build for a CPU with amx_bf16 multiplies on the tiles (Linux >= 5.16 allows them)."""
    assert NATIVE is not None
    flags = set(machine.cpu_flags().split())
    release = tuple(int(p) for p in re.findall(r"\d+", platform.release())[:2])
    expected = ({"amx_bf16", "amx_tile"} <= flags and release >= (5, 16)
                and target_arch() == "native")
    assert NATIVE.amx_bfloat16 == expected


def test_packed_matmul_refuses_what_it_would_misread() -> None:
    assert NATIVE is not None
    weight = torch.randn(16, 32, dtype=DTYPE)
    packed = NATIVE.pack_matmul_weight(weight)
    x, out = torch.randn(5, 32, dtype=DTYPE), torch.empty(5, 16, dtype=DTYPE)
    with pytest.raises(ValueError, match="float16 not supported"):
        NATIVE.pack_matmul_weight(weight.half())
    with pytest.raises(ValueError, match="contiguous"):
        NATIVE.pack_matmul_weight(weight.t())
    with pytest.raises(ValueError, match=f"{packed_matmul_size(16, 32)} elements"):
        NATIVE.packed_matmul(x, packed[:-32], 16, None, out)  # packed for fewer columns
    with pytest.raises(ValueError, match="5 input rows, 4 output rows"):
        NATIVE.packed_matmul(x, packed, 16, None, out[:4])
    with pytest.raises(ValueError, match="contiguous rows"):
        NATIVE.packed_matmul(torch.randn(32, 5, dtype=DTYPE).t(), packed, 16, None, out)
    assert (NATIVE.packed_matmul(x, packed, 16, None, out) is None
            and torch.allclose(out.float(), (x @ weight.T).float(), rtol=2 ** -7, atol=1e-3))


@needs_bfloat16
def test_packed_matmul_refuses_an_odd_k_in_bfloat16() -> None:
    assert NATIVE is not None
    with pytest.raises(ValueError, match="K must be even"):
        NATIVE.pack_matmul_weight(torch.randn(16, 33, dtype=torch.bfloat16))


def test_cpu_kernel_packs_once_and_runs_the_packed_product_above_three_rows() -> None:
    weight = torch.randn(80, 48, dtype=DTYPE)
    kernel, layer = cpu_kernel(weight)
    assert kernel.packed is None and kernel.panels is not None  # no oneDNN copy
    bias = torch.randn(80, dtype=DTYPE)
    for rows in (1, SMALL_MATMUL_ROWS, SMALL_MATMUL_ROWS + 1, 64, 600):
        x = torch.randn(rows, 48, dtype=DTYPE)
        torch.testing.assert_close(kernel.apply(layer, x, bias), F.linear(x, weight, bias))
    # Which loop runs: with the dense weight zeroed after packing, the small-batch loop
    # (which reads it) gives the bias alone, the packed one (which reads the panels) the
    # product. The choice is made in C (engine_matmul), as a recorded step graph makes it.
    # bfloat16 panels on AMX take every row count.
    weight = weight.clone()
    layer.weight.data.zero_()
    amx = DTYPE == torch.bfloat16 and NATIVE is not None and NATIVE.amx_bfloat16
    for rows in (1, SMALL_MATMUL_ROWS):
        x = torch.randn(rows, 48, dtype=DTYPE)
        if amx:
            torch.testing.assert_close(kernel.apply(layer, x, bias), F.linear(x, weight, bias))
        else:
            assert torch.equal(kernel.apply(layer, x, bias), bias.expand(rows, 80))
    for rows in (SMALL_MATMUL_ROWS + 1, 64):
        x = torch.randn(rows, 48, dtype=DTYPE)
        torch.testing.assert_close(kernel.apply(layer, x, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize("weight", [
    pytest.param(torch.randn(80, 47, dtype=torch.bfloat16), marks=needs_bfloat16),  # no pairs
    torch.randn(48, 80, dtype=DTYPE).t(),  # not contiguous: not read flat
], ids=["odd-k", "strided"])
def test_cpu_kernel_uses_onednn_where_the_weight_cannot_be_packed(weight: torch.Tensor) -> None:
    kernel, layer = cpu_kernel(weight)
    assert kernel.panels is None and kernel.packed is not None
    x = torch.randn(64, weight.shape[1], dtype=weight.dtype)
    torch.testing.assert_close(kernel.apply(layer, x), F.linear(x, weight))


def test_cpu_kernel_with_autograd_falls_back_to_f_linear() -> None:
    weight = torch.randn(80, 48)
    kernel, layer = cpu_kernel(weight)
    x = torch.randn(8, 48, requires_grad=True)
    out = kernel.apply(layer, x)
    out.sum().backward()  # F.linear's graph, not the C++ kernels'
    assert x.grad is not None
    torch.testing.assert_close(x.grad, weight.sum(0).expand(8, 48))


WIDENS = NATIVE is not None and NATIVE.packs_float32_as_bfloat16
needs_widening = pytest.mark.skipif(
    not WIDENS, reason="float32 weights are packed as bfloat16 by AVX2 builds only (AVX-512 "
    "builds keep float32 panels; test_native_avx2_build runs this file on an AVX2 build)")


@needs_widening
@pytest.mark.parametrize(("n", "k"), [(64, 768), (100, 98), (40, 2), (24, 33)])  # last panel cut
def test_float32_weight_of_bfloat16_values_packed_as_bfloat16_gives_the_same_sums(
        n: int, k: int) -> None:
    assert NATIVE is not None
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16().float()  # a bf16 checkpoint in fp32
    bias = torch.randn(n, generator=gen)
    panels = NATIVE.pack_matmul_weight(weight)
    halves = NATIVE.pack_matmul_weight(weight, as_bfloat16=True)
    assert panels is not None and halves is not None
    assert halves.dtype == torch.bfloat16 and halves.shape == panels.shape
    for rows in (1, SMALL_MATMUL_ROWS, 4, 13, 300):
        x = torch.randn(rows, k + 6, generator=gen)[:, :k]
        for b in (bias, None):
            want, got, picked = (torch.empty(rows, n) for _ in range(3))
            NATIVE.packed_matmul(x, panels, n, b, want)
            NATIVE.packed_matmul(x, halves, n, b, got)
            NATIVE.matmul(x, weight, halves, b, picked)  # the panels at every row count
            assert torch.equal(got, want) and torch.equal(picked, want), rows


@needs_widening
def test_float32_weight_with_other_values_is_not_packed_as_bfloat16() -> None:
    assert NATIVE is not None
    weight = torch.randn(40, 32).bfloat16().float()
    weight[37, 31] = torch.nextafter(weight[37, 31], torch.tensor(2.0))  # one value, the last tile
    assert NATIVE.pack_matmul_weight(weight, as_bfloat16=True) is None
    with pytest.raises(ValueError, match="as_bfloat16 takes a float32 weight"):
        NATIVE.pack_matmul_weight(weight.double(), as_bfloat16=True)


@needs_widening
def test_cpu_kernel_keeps_a_bfloat16_checkpoint_run_in_float32_as_bfloat16_panels() -> None:
    weight = torch.randn(80, 48).bfloat16().float()
    kernel, layer = cpu_kernel(weight)
    assert kernel.panels is not None and kernel.panels.dtype == torch.bfloat16
    bias = torch.randn(80)
    outs = {}
    for rows in (1, SMALL_MATMUL_ROWS, SMALL_MATMUL_ROWS + 1, 64):
        x = torch.randn(rows, 48)
        outs[rows] = x, kernel.apply(layer, x, bias)
        torch.testing.assert_close(outs[rows][1], F.linear(x, weight, bias))
    layer.weight.data.zero_()  # every row count reads the panels, not the dense weight
    for x, out in outs.values():
        assert torch.equal(kernel.apply(layer, x, bias), out)
    other, _ = cpu_kernel(torch.randn(80, 48))  # float32 values: float32 panels
    assert other.panels is not None and other.panels.dtype == torch.float32


@pytest.mark.skipif(WIDENS or torch.float32 not in BUILT,
                    reason="an AVX-512 build's refusal (AVX2 builds widen)")
def test_avx512_builds_refuse_to_pack_float32_as_bfloat16() -> None:
    assert NATIVE is not None
    with pytest.raises(ValueError, match="AVX2 kernel for it"):
        NATIVE.pack_matmul_weight(torch.randn(16, 32).bfloat16().float(), as_bfloat16=True)
    kernel, _ = cpu_kernel(torch.randn(80, 48).bfloat16().float())
    assert kernel.panels is not None and kernel.panels.dtype == torch.float32
