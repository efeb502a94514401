"""Linear kernels for GGUF weights (scheme ``"gguf"``; entries of ``engine.linear_kernels``).

* ``gguf_dequant`` (priority 0, every format, every device): dequantizes the layer's rows
  in chunks of about ``CHUNK_ELEMENTS`` weights into a reused scratch buffer
  (``scratch.py``) and multiplies each chunk with ``F.linear`` (1 to 3 tokens on the CPU:
  the ``cpu`` linear kernel's small-batch product). Exact: the result equals what the
  unquantized model's kernel gives on the weight dequantized at load time, bit for bit (a
  chunk of rows gives the same sums as the whole matrix).
* ``gguf_int4`` (priority 100, CPU, Q4_0 / Q4_1 / Q4_K, output rows a multiple of 64):
  repacks the 4-bit values once into torch's CPU int4 layout with one (scale, zero) pair
  per 32 weights (``w = (q - 8) * scale + zero``: Q4_0 zero = 0, Q4_1 zero = m + 8 d,
  Q4_K scale = d sc_j, zero = 8 scale - dmin m_j), the same 4.5-5 bits per weight, and
  multiplies with the fused ``_weight_int4pack_mm_for_cpu`` for up to
  ``FUSED_MAX_TOKENS`` tokens (decode of small batches: it reads 4-bit weights). For more
  tokens it dequantizes its own layout, transposed, into the scratch buffer (C++ loop,
  ``native/gguf_dequant.cpp``; torch ops where that is not built) and uses the bf16
  matmul, which is faster there. Scales and zeros are rounded to the activation dtype, so
  results differ from the dequantized weights by about that rounding (bf16: ~0.3% of an
  output), and greedy tokens can part from the dequantized path's where two logits nearly
  tie.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu.native.library import (
    DTYPE_CODES,
    SMALL_MATMUL_ROWS,
    NativeKernels,
    native_kernels,
)
from engine.kernels.gguf.formats import (
    FORMATS,
    GGUFFormat,
    _f16,
    _k_group_scales,
    _k_nibbles,
    _nibbles,
)
from engine.kernels.gguf.scratch import scratch
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

SCHEME = "gguf"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

#: Weights dequantized per chunk (2**21: 4 MiB of bf16 plus 8 MiB of float32 temporaries;
#: fewer, larger chunks beat cache-sized ones: per-op overhead dominates on 2 cores).
CHUNK_ELEMENTS = 1 << 21

#: Up to this many tokens ``gguf_int4`` uses the fused int4 matmul; above, dequant + bf16.
#: The fused matmul reads 4-bit weights (2.3x faster than bf16 at 1 token) but its compute
#: grows with the tokens; the C++ dequantization (~13 G weights/s on 2 Zen 4 cores) costs
#: the same at any count. SmolLM2's four products per layer, ms (fused / dequant + matmul):
#: 0.70 / 1.06 at 16 tokens, 1.09 / 1.07 at 24, 1.55 / 1.43 at 32, 2.74-2.91 / 1.74-1.83 at 64.
FUSED_MAX_TOKENS = 24


def _gguf_scheme(config: LinearKernelConfig, formats: tuple[str, ...]) -> Support:
    if config.scheme != SCHEME:
        return Support.no(f"scheme {config.scheme} is not {SCHEME}")
    if config.weight_dtype not in formats:
        return Support.no(f"GGUF type {config.weight_dtype} is not supported; supported: "
                          f"{', '.join(formats)}")
    if config.act_dtype not in FLOAT_DTYPES:
        return Support.no(f"activation dtype {config.act_dtype} is not supported; supported: "
                          f"{', '.join(FLOAT_DTYPES)}")
    return Support.yes()


def _weight(layer: nn.Module) -> torch.Tensor:
    weight = layer.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"the layer has no 'weight' tensor, got {weight!r}")
    return weight


def _small_kernels(x: torch.Tensor) -> NativeKernels | None:
    """The C++ kernels, where their small-batch products take ``x``; else None.

    They take 1 to ``SMALL_MATMUL_ROWS`` rows of a dtype they have on this CPU, outside
    autograd.
    """
    kernels = native_kernels()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (kernels is None or not x.is_cpu or not 0 < rows <= SMALL_MATMUL_ROWS
            or x.dtype not in kernels.small_matmul_dtypes
            or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    return kernels


def chunked_matmul(x: torch.Tensor, rows: int, cols: int, bias: torch.Tensor | None,
                   dequantize: Callable[[int, int, torch.Tensor], torch.Tensor],
                   step: int) -> torch.Tensor:
    """``x @ W^T + b`` with ``W`` produced ``step`` rows at a time by ``dequantize``.

    ``dequantize(start, stop, out)`` writes rows ``[start, stop)`` of ``W`` into ``out``
    ``[stop - start, cols]`` (a view of the scratch buffer) and returns them: ``out``, or
    another view of its memory (``gguf_int4`` writes ``W^T`` there and returns its
    transpose). Each chunk is
    multiplied as the unquantized model's linear kernel would: ``F.linear``, or for 1 to
    ``SMALL_MATMUL_ROWS`` tokens on the CPU the engine's small-batch kernel (the ``cpu``
    linear kernel's; a row's sum does not depend on the chunks, so both give the same
    values as on the whole dequantized weight).
    """
    x2 = x.reshape(-1, cols)
    buffer = scratch(min(step, rows) * cols, x.dtype, x.device)
    small = _small_kernels(x)
    if rows <= step and small is None:
        weight = dequantize(0, rows, buffer.view(rows, cols))
        return F.linear(x2, weight, bias).view(*x.shape[:-1], rows)
    if small is not None and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        weight = dequantize(start, stop, buffer[:(stop - start) * cols].view(stop - start, cols))
        part_bias = None if bias is None else bias[start:stop]
        if small is not None:
            small.small_matmul(x2, weight, part_bias, out[:, start:stop])
        else:
            out[:, start:stop] = F.linear(x2, weight, part_bias)
    return out.view(*x.shape[:-1], rows)


class GGUFDequantKernel(LinearKernel):
    """Every GGUF format: dequantize chunks of rows into scratch, then ``F.linear``."""

    name: ClassVar[str] = "gguf_dequant"
    priority: ClassVar[int] = 0

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        return _gguf_scheme(config, tuple(FORMATS))

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        fmt = FORMATS[self.config.weight_dtype]
        data = _weight(layer)
        cols = self.config.input_size

        def fill(start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
            return fmt.dequantize(data[start:stop], out)

        if fmt.name == "Q8_0":
            direct = _q8_0_small_matmul(x, data, cols, bias)
            if direct is not None:
                return direct
        step = max(1, CHUNK_ELEMENTS // cols)
        return chunked_matmul(x, data.shape[0], cols, bias, fill, step)

    def capture_support(self, ctx: CaptureContext) -> Support:
        """CUDA graphs: torch ops without host synchronisation; never the CPU step graph."""
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return Support.yes()
        return Support.no("it dequantizes and multiplies in torch, which the CPU step graph "
                          "cannot replay")


def _q8_0_small_matmul(x: torch.Tensor, data: torch.Tensor, cols: int,
                       bias: torch.Tensor | None) -> torch.Tensor | None:
    """1 to ``SMALL_MATMUL_ROWS`` tokens times Q8_0 rows read as stored (C++).

    The values equal ``chunked_matmul``'s; None where the kernel does not apply.
    """
    kernels = _small_kernels(x)
    if kernels is None or not data.is_contiguous():
        return None
    x2 = x.reshape(-1, cols)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], data.shape[0], dtype=x.dtype, device=x.device)
    kernels.small_matmul_q8_0(x2, data, bias, out)
    return out.view(*x.shape[:-1], data.shape[0])


def int4_fields(fmt: GGUFFormat, data: torch.Tensor, cols: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, zero)`` of Q4_0/Q4_1/Q4_K rows: ``w = (q - 8) * scale + zero``.

    ``q`` is ``int32 [rows, cols]`` in 0..15; ``scale`` and ``zero`` float32
    ``[rows, cols / 32]``.
    """
    rows = data.shape[0]
    blocks = data.reshape(-1, fmt.type_size)
    if fmt.name == "Q4_K":
        scale, offset = _k_group_scales(blocks)
        q = _k_nibbles(blocks[:, 16:])
        zero = 8 * scale - offset
    else:
        start = 2 if fmt.name == "Q4_0" else 4
        scale = _f16(blocks[:, :2])
        q = _nibbles(blocks[:, start:])
        zero = torch.zeros_like(scale) if fmt.name == "Q4_0" else _f16(blocks[:, 2:4]) + 8 * scale
    groups = cols // 32
    return (q.reshape(rows, cols).to(torch.int32), scale.reshape(rows, groups),
            zero.reshape(rows, groups))


@functools.cache
def int4pack_block() -> int:
    """Rows per tile of torch's CPU int4 layout on this machine; 0 for one not read here.

    ``_convert_weight_to_int4pack_for_cpu(q, 1)`` gives ``uint8 [N / B, K, B / 2]``, byte
    ``[b][k][i]`` holding rows ``B b + i`` (low nibble) and ``B b + B / 2 + i`` (high). torch
    picks B by the instructions its kernel runs with: 64 on AVX-512 CPUs, 32 on AVX2 ones.
    Found by packing a known 64 x 32 weight and reading it back in each layout.
    """
    q = ((torch.arange(64)[:, None] * 5 + torch.arange(32)[None, :] * 3) % 16).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).flatten()
    for block in (64, 32):
        tiles = packed.view(64 // block, 32, block // 2)
        rows = torch.cat((tiles & 0x0F, tiles >> 4), dim=2).transpose(1, 2).reshape(64, 32)
        if torch.equal(rows.to(torch.int32), q):
            return block
    return 0


class GGUFInt4Kernel(LinearKernel):
    """Q4_0 / Q4_1 / Q4_K through torch's fused CPU int4 matmul (see the module docstring)."""

    name: ClassVar[str] = "gguf_int4"
    priority: ClassVar[int] = 100
    FORMATS: ClassVar[tuple[str, ...]] = ("Q4_0", "Q4_1", "Q4_K")

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        if platform.device_type != "cpu":
            return Support.no(f"runs on the CPU only, not {platform.device_type}")
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return Support.no(f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu")
        if int4pack_block() == 0:
            return Support.no(f"torch {torch.__version__}'s CPU int4 layout here is not one "
                              f"this kernel reads (tiles of 64 or 32 rows)")
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        answer = _gguf_scheme(config, cls.FORMATS)
        if answer.ok and config.output_size % 64:
            return Support.no(f"{config.output_size} output rows are not a multiple of 64")
        return answer

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        fmt = FORMATS[self.config.weight_dtype]
        cols = self.config.input_size
        q, scale, zero = int4_fields(fmt, _weight(layer).detach(), cols)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        dtype = getattr(torch, self.config.act_dtype)
        scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)
        # Replaces this layer's parameter only (a tied embedding keeps its GGUF rows).
        layer.register_parameter("weight", nn.Parameter(packed, requires_grad=False))
        layer.register_parameter("weight_scales_zeros",
                                 nn.Parameter(scales_zeros, requires_grad=False))

    def _dequantize(self, layer: nn.Module, start: int, stop: int,
                    out: torch.Tensor) -> torch.Tensor:
        """Rows ``[start, stop)`` (multiples of 64) of ``W`` from the int4 layout."""
        cols = self.config.input_size
        block = int4pack_block()
        packed = _weight(layer).view(-1, cols, block // 2)[start // block:stop // block]
        q = torch.stack((packed & 0x0F, packed >> 4), dim=1).transpose(2, 3)
        sz: torch.Tensor = layer.weight_scales_zeros  # type: ignore[assignment]
        scale = sz[:, start:stop, 0].t().float().unsqueeze(-1)
        zero = sz[:, start:stop, 1].t().float().unsqueeze(-1)
        values = (q.reshape(stop - start, cols // 32, 32).float() - 8) * scale + zero
        return out.copy_(values.view(stop - start, cols))

    def _native_fill(self, layer: nn.Module, x: torch.Tensor
                     ) -> Callable[[int, int, torch.Tensor], torch.Tensor] | None:
        """``chunked_matmul``'s ``dequantize`` through the C++ loop, or None.

        None where the loop is not built or takes no ``x.dtype``. The loop writes ``W^T``
        ``[cols, stop - start]`` into the chunk's scratch memory; the chunk is that
        buffer's transpose (``F.linear`` on it is ``x @ W^T``).
        """
        kernels = native_kernels()
        if kernels is None or x.dtype not in DTYPE_CODES or not x.is_cpu:
            return None
        cols = self.config.input_size
        packed = _weight(layer).view(-1, cols, int4pack_block() // 2)
        sz: torch.Tensor = layer.weight_scales_zeros  # type: ignore[assignment]

        def fill(start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
            weight_t = out.view(cols, stop - start)  # the same contiguous scratch
            kernels.int4pack_dequant_t(packed, sz, start, stop, weight_t)
            return weight_t.t()

        return fill

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        cols, rows = self.config.input_size, self.config.output_size
        x2 = x.reshape(-1, cols)
        if x2.shape[0] > FUSED_MAX_TOKENS:
            step = max(64, CHUNK_ELEMENTS // cols // 64 * 64)
            fill = self._native_fill(layer, x) or (
                lambda a, b, out: self._dequantize(layer, a, b, out))
            return chunked_matmul(x, rows, cols, bias, fill, step)
        sz: torch.Tensor = layer.weight_scales_zeros  # type: ignore[assignment]
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.contiguous(), _weight(layer), 32, sz)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], rows)
