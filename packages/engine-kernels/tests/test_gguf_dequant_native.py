"""The C++ dequantization of GGUF weights (``native/gguf_dequant.cpp``).

``gguf_dequant`` (Q4_0 / Q4_1 / Q8_0 blocks, what ``GGUFFormat.dequantize`` and the exact
``gguf_dequant`` kernel use) and ``int4pack_dequant_t`` (``gguf_int4``'s layout, above
``FUSED_MAX_TOKENS``) must give the torch code's values bit for bit: checked against that
code with the C++ path switched off, on sizes that run on one thread and on several, with
float16 scales that are subnormal, infinite or NaN (a NaN comes out as a NaN; its payload
is not compared). ``small_matmul_q8_0`` (1-3 tokens times Q8_0 rows, read as stored) must
give the dense small-batch kernel's values on the dequantized rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu.native import native_kernels
from engine.kernels.gguf import formats as gguf_formats
from engine.kernels.gguf import kernels as gguf_kernels
from engine.kernels.gguf.formats import FORMATS
from engine.kernels.gguf.kernels import (
    GGUFDequantKernel,
    GGUFInt4Kernel,
    int4pack_block,
)
from engine.testing.gguf_blocks import kernel_layer, raw_blocks

KERNELS = native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the engine's C++ kernels are not built")
DTYPES = (torch.float32, torch.bfloat16)


def torch_dequantize(name: str, data: torch.Tensor, dtype: torch.dtype,
                     monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """``FORMATS[name].dequantize`` through the torch ops only."""
    with monkeypatch.context() as patch:
        patch.setattr(gguf_formats, "_native_dequant", lambda *args: False)
        return FORMATS[name].dequantize(data, torch.empty(data.shape[0], data.shape[1] * 32
                                                          // FORMATS[name].type_size,
                                                          dtype=dtype))


def odd_scales(data: np.ndarray, type_size: int) -> np.ndarray:
    """The first blocks' ``d`` set to a subnormal, the largest float16, inf and NaN."""
    blocks = data.reshape(-1, type_size)
    for i, value in enumerate((6e-8, 3e-5, 65504.0, np.inf, np.nan)):
        blocks[i, :2] = np.array([value], dtype=np.float16).view(np.uint8)
    return data


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [3, 256])  # one thread; past the parallel threshold
def test_blocks_equal_the_torch_ops(name: str, dtype: torch.dtype, rows: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = FORMATS[name]
    data = torch.from_numpy(odd_scales(raw_blocks(name, rows, 288), fmt.type_size))
    want = torch_dequantize(name, data, dtype, monkeypatch)
    got = torch.full_like(want, 7.0)
    assert KERNELS is not None
    KERNELS.gguf_dequant(fmt.qtype, data.reshape(-1, fmt.type_size), got)
    assert_same_values(got, want)
    assert torch.isnan(got).any() and torch.isinf(got).any()  # the odd scales were read
    # The format's own entry point takes the C++ path and gives the same values.
    assert_same_values(fmt.dequantize(data, torch.empty_like(want)), want)


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, signed zeros included; a NaN where torch has one (any payload)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def test_blocks_refuse_what_they_cannot_read() -> None:
    assert KERNELS is not None
    blocks = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q4_1 \(3, 20 bytes\).*got type 14"):
        KERNELS.gguf_dequant(14, blocks, torch.empty(128))  # Q6_K has no C++ loop
    with pytest.raises(ValueError, match=r"got type 8 \(4, 20\)"):
        KERNELS.gguf_dequant(8, blocks, torch.empty(128))  # Q8_0 blocks are 34 bytes
    with pytest.raises(ValueError, match="out as a contiguous torch.float32 CPU tensor of 128"):
        KERNELS.gguf_dequant(3, blocks, torch.empty(100))
    with pytest.raises(ValueError, match="not supported"):
        KERNELS.gguf_dequant(3, blocks, torch.empty(128, dtype=torch.float16))


def test_float16_and_strided_outputs_keep_the_torch_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.from_numpy(raw_blocks("Q4_1", 4, 64))
    for out in (torch.empty(4, 64, dtype=torch.float16), torch.empty(64, 4).t()):
        assert not gguf_formats._native_dequant(3, data.reshape(-1, 20), out)
    want = torch_dequantize("Q4_1", data, torch.float16, monkeypatch)
    assert torch.equal(FORMATS["Q4_1"].dequantize(data, torch.empty(4, 64,
                                                                    dtype=torch.float16)), want)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_layout_equals_the_torch_ops(name: str, dtype: str) -> None:
    cols = 512 if name == "Q4_K" else 288
    kernel, layer, _ = kernel_layer(GGUFInt4Kernel, name, 320, cols, dtype)
    torch_dtype = getattr(torch, dtype)
    packed = layer.weight.view(-1, cols, int4pack_block() // 2)
    assert KERNELS is not None
    for start, stop in ((0, 320), (64, 192), (256, 320)):
        want = kernel._dequantize(layer, start, stop,
                                  torch.empty(stop - start, cols, dtype=torch_dtype))
        got = torch.empty(cols, stop - start, dtype=torch_dtype)
        KERNELS.int4pack_dequant_t(packed, layer.weight_scales_zeros, start, stop, got)
        assert torch.equal(got.t(), want), (start, stop)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_layout_read_back_gives_the_gguf_weights(name: str) -> None:
    """The layout torch packs on this CPU (tiles of 64 rows on AVX-512, 32 on AVX2) is read
    back as the file's weights: the C++ loop and the torch ops, every row in its place."""
    assert int4pack_block() in (64, 32)
    cols = 512 if name == "Q4_K" else 96
    kernel, layer, weight = kernel_layer(GGUFInt4Kernel, name, 192, cols, "float32")
    torch_ops = kernel._dequantize(layer, 0, 192, torch.empty(192, cols))
    torch.testing.assert_close(torch_ops, weight, rtol=1e-5, atol=1e-5)  # zero = m + 8 d
    got = torch.empty(cols, 192)
    assert KERNELS is not None
    KERNELS.int4pack_dequant_t(layer.weight.view(-1, cols, int4pack_block() // 2),
                               layer.weight_scales_zeros, 0, 192, got)
    assert torch.equal(got.t(), torch_ops)


def test_int4_layout_refuses_bad_ranges() -> None:
    _, layer, _ = kernel_layer(GGUFInt4Kernel, "Q4_1", 128, 64, "bfloat16")
    packed, sz = layer.weight.view(-1, 64, int4pack_block() // 2), layer.weight_scales_zeros
    assert KERNELS is not None
    for start, stop, out in ((0, 100, torch.empty(64, 100, dtype=torch.bfloat16)),
                             (64, 192, torch.empty(64, 128, dtype=torch.bfloat16)),
                             (0, 64, torch.empty(64, 32, dtype=torch.bfloat16))):
        with pytest.raises(ValueError, match="multiples of 64 within the weight"):
            KERNELS.int4pack_dequant_t(packed, sz, start, stop, out)
    with pytest.raises(ValueError, match=r"packed uint8 \[N / B, K, B / 2\] with B 64 or 32, "
                                         r"got \(128, 32\)"):
        KERNELS.int4pack_dequant_t(layer.weight, sz, 0, 64, torch.empty(64, 64))
    with pytest.raises(ValueError, match="scales_zeros as a contiguous torch.float32"):
        KERNELS.int4pack_dequant_t(packed, sz, 0, 64, torch.empty(64, 64))  # out float32
    with pytest.raises(ValueError, match="out as a contiguous torch.bfloat16"):
        KERNELS.int4pack_dequant_t(packed, sz, 0, 64,
                                   torch.empty(64, 128, dtype=torch.bfloat16)[:, :64])


@pytest.mark.parametrize("bias", [False, True])
def test_int4_kernel_above_the_fused_size(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dequantized by the C++ loop, in one chunk or several: the torch path's results."""
    kernel, layer, weight = kernel_layer(GGUFInt4Kernel, "Q4_1", 384, 96, "bfloat16")
    b = torch.randn(384, dtype=torch.bfloat16) if bias else None
    x = torch.randn(gguf_kernels.FUSED_MAX_TOKENS + 5, 96, dtype=torch.bfloat16)
    with monkeypatch.context() as patch:
        patch.setattr(gguf_kernels, "native_kernels", lambda: None)
        want = kernel.apply(layer, x, b)
    for chunk in (gguf_kernels.CHUNK_ELEMENTS, 96 * 128):  # one chunk; three of 128 rows
        monkeypatch.setattr(gguf_kernels, "CHUNK_ELEMENTS", chunk)
        got = kernel.apply(layer, x, b)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # bf16 sums, any order
    reference = F.linear(x.float(), weight, None if b is None else b.float())
    error = (got.float() - reference).norm() / reference.norm()
    assert error < 1e-2  # the int4 scales' rounding to bf16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_q8_0_small_matmul_equals_the_dense_kernel(dtype: torch.dtype, tokens: int,
                                                   bias: bool) -> None:
    """Read from the blocks: the dense small-batch kernel's values on the dequantized rows."""
    assert KERNELS is not None
    if dtype not in KERNELS.small_matmul_dtypes:
        pytest.skip(f"no small-batch kernel for {dtype} on this CPU")
    rows, cols = 200, 288  # 9 blocks a row (odd: the bf16 loop's tail); rows not a multiple of 16
    data = torch.from_numpy(raw_blocks("Q8_0", rows, cols))
    weight = FORMATS["Q8_0"].dequantize(data, torch.empty(rows, cols, dtype=dtype))
    x = torch.randn(tokens, cols, dtype=dtype)
    b = torch.randn(rows, dtype=dtype) if bias else None
    want, got = torch.empty(tokens, rows, dtype=dtype), torch.empty(tokens, rows, dtype=dtype)
    KERNELS.small_matmul(x, weight, b, want)
    KERNELS.small_matmul_q8_0(x, data, b, got)
    assert torch.equal(got, want)


def test_q8_0_dequant_kernel_reads_the_blocks_for_few_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert KERNELS is not None
    if torch.bfloat16 not in KERNELS.small_matmul_dtypes:
        pytest.skip("no bfloat16 small-batch kernel on this CPU")
    kernel, layer, _ = kernel_layer(GGUFDequantKernel, "Q8_0", 96, 64, "bfloat16")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    want = kernel.apply(layer, x)

    def no_chunks(*args: object) -> torch.Tensor:
        raise AssertionError("dequantized into the scratch buffer")

    monkeypatch.setattr(gguf_kernels, "chunked_matmul", no_chunks)
    assert torch.equal(kernel.apply(layer, x), want)
    with pytest.raises(AssertionError, match="scratch"):  # more tokens still dequantize
        kernel.apply(layer, torch.randn(4, 64, dtype=torch.bfloat16))


def test_q8_0_small_matmul_refuses_bad_shapes() -> None:
    assert KERNELS is not None
    if torch.float32 not in KERNELS.small_matmul_dtypes:
        pytest.skip("no float32 small-batch kernel on this CPU")
    data = torch.zeros(16, 2 * 34, dtype=torch.uint8)
    out = torch.empty(1, 16)
    with pytest.raises(ValueError, match=r"Q8_0 blocks \[N, K / 32 \* 34\]"):
        KERNELS.small_matmul_q8_0(torch.empty(1, 96), data, None, out)  # 3 blocks, not 2
    with pytest.raises(ValueError, match="1..3 rows"):
        KERNELS.small_matmul_q8_0(torch.empty(4, 64), data, None, torch.empty(4, 16))
    with pytest.raises(ValueError, match="not supported"):
        KERNELS.small_matmul_q8_0(torch.empty(1, 64, dtype=torch.float16), data, None,
                                  torch.empty(1, 16, dtype=torch.float16))
