"""GGUF block formats in torch: layouts and exact dequantization.

A GGUF weight ``[rows, cols]`` is stored row by row, each row as ``cols / block_size``
blocks of ``type_size`` bytes; the engine keeps exactly those bytes, as a ``uint8`` tensor
``[rows, cols / block_size * type_size]``. Layouts (llama.cpp ``ggml-common.h``; ``d``,
``m``, ``dmin`` are float16; ``qs`` packs two 4-bit values per byte, elements 0..15 of a
32-group in the low nibbles, 16..31 in the high ones)::

    Q8_0  34 B / 32: d, int8 q[32]                          w = d * q
    Q4_0  18 B / 32: d, qs[16]                              w = d * (q - 8)
    Q4_1  20 B / 32: d, m, qs[16]                           w = d * q + m
    Q5_0  22 B / 32: d, qh[4] (bit 4 of each q), qs[16]     w = d * (q - 16)
    Q5_1  24 B / 32: d, m, qh[4], qs[16]                    w = d * q + m
    Q4_K 144 B / 256: d, dmin, 12 B of 6-bit (scale, min) for 8 groups of 32, qs[128]
                                                            w = d*sc_j * q - dmin*m_j
    Q5_K 176 B / 256: as Q4_K plus qh[32] (bit 4)           w = d*sc_j * q - dmin*m_j
    Q6_K 210 B / 256: ql[128], qh[64], int8 scales[16], d   w = d*sc_j * (q - 32), 16 groups

Every ``dequantize_*`` here computes in float32 with the operations, in the order, that
``gguf.quants`` (numpy) uses, so the result equals the engine's load-time dequantization
bit for bit (``tests/test_quantization_gguf.py`` checks every format).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., 2k]`` read as ``k`` float16 values, widened to float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, g, 16]`` bytes -> ``[n, g, 32]`` 4-bit values (low nibbles first)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """The lowest ``count`` bits of each little-endian uint32 in ``qh`` ``[n, 4]`` (0/1)."""
    words = qh.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(count, dtype=torch.int64, device=qh.device)
    return ((words >> shifts) & 1).to(torch.uint8)


def dequantize_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def dequantize_f16(b: torch.Tensor) -> torch.Tensor:
    return _f16(b)


def dequantize_bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


def _f16_view(raw: torch.Tensor) -> torch.Tensor:
    """Bytes ``[n, 2]`` (any row stride, even offsets) read in place as float16, to float32."""
    return raw.view(torch.float16).float()


def fill_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_f16_view(b[:, :2]))


def _fill_nibbles(qs: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the 4-bit values of ``qs`` ``[n, 16]``, low nibbles first.

    Unpacked into a uint8 scratch several nibbles per operation (as int32/int16 words where
    the row stride allows), then converted in one contiguous copy: the strided byte
    operations were the cost.
    """
    from engine.kernels.gguf.scratch import scratch

    half = qs.shape[-1]
    values = scratch(out.numel(), torch.uint8, out.device).view(out.shape)
    for wide, mask in ((torch.int32, 0x0F0F0F0F), (torch.int16, 0x0F0F)):
        size = torch.tensor([], dtype=wide).element_size()
        if qs.stride(0) % size == 0 and qs.storage_offset() % size == 0 and half % size == 0:
            words, unpacked = qs.view(wide), values.view(wide)  # several nibbles per op
            lo, hi = unpacked[:, :half // size], unpacked[:, half // size:]
            torch.bitwise_and(words, mask, out=lo)
            torch.bitwise_right_shift(words, 4, out=hi).bitwise_and_(mask)
            break
    else:
        torch.bitwise_and(qs, 0x0F, out=values[:, :half])
        torch.bitwise_right_shift(qs, 4, out=values[:, half:])
    out.copy_(values)


def fill_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    _fill_nibbles(b[:, 2:], out)
    out.sub_(8)  # exact: small integers
    out.mul_(_f16_view(b[:, :2]))


def fill_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    _fill_nibbles(b[:, 4:], out)
    out.mul_(_f16_view(b[:, :2]))
    out.add_(_f16_view(b[:, 2:4]))


def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32, device=b.device)
    fill_q8_0(b, out)
    return out


def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32, device=b.device)
    fill_q4_0(b, out)
    return out


def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32, device=b.device)
    fill_q4_1(b, out)
    return out


def dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = (_nibbles(b[:, 6:]) | (_bits(b[:, 2:6], 32) << 4)).to(torch.int8) - 16
    return d * q.float()


def dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8], 32) << 4)
    return (d * q.float()) + m


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (``get_scale_min_k4``)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_group_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: ``(d * sc_j, dmin * m_j)`` per group of 32, each ``[n, 8, 1]``."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc.float()).reshape(n, 8, 1), (dmin * mn.float()).reshape(n, 8, 1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """K-quants: ``[n, 128]`` bytes -> ``[n, 8, 32]``: each 32 bytes give two groups."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8,
                                                device=qs.device).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, 8, 32)


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, offset = _k_group_scales(b)
    q = _k_nibbles(b[:, 16:]).float()
    return (scale * q - offset).reshape(n, QK_K)


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, offset = _k_group_scales(b)
    qh = b[:, 16:48].reshape(n, 1, 1, 32) >> torch.arange(
        8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1)
    q = _k_nibbles(b[:, 48:]) | ((qh & 0x01).reshape(n, 8, 32) << 4)
    return (scale * q.float() - offset).reshape(n, QK_K)


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    low = ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8,
                                                  device=b.device).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(n, 8, 32)
    high = qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                   device=b.device).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


def _native_dequant(qtype: int, blocks: torch.Tensor, out: torch.Tensor) -> bool:
    """Dequantize through the C++ kernels where they take these blocks; False otherwise."""
    from engine.kernels.cpu.native.library import DTYPE_CODES, GGUF_DEQUANT_TYPES, native_kernels

    if (qtype not in GGUF_DEQUANT_TYPES or out.dtype not in DTYPE_CODES or not out.is_cpu
            or not blocks.is_contiguous() or not out.is_contiguous()):
        return False
    kernels = native_kernels()
    if kernels is None:
        return False
    kernels.gguf_dequant(qtype, blocks, out)
    return True


@dataclass(frozen=True)
class GGUFFormat:
    """One GGUF storage type.

    Attributes:
        name: The ggml type name, e.g. ``"Q4_1"`` (``LinearKernelConfig.weight_dtype``).
        qtype: Its ``GGMLQuantizationType`` value.
        block_size: Weights per block (``LinearKernelConfig.group_size``).
        type_size: Bytes per block.
        zero_point: Whether blocks carry an offset (``m`` / ``dmin``).
        dequantize_blocks: ``uint8 [n, type_size]`` -> ``float32 [n, block_size]``.
    """

    name: str
    qtype: int
    block_size: int
    type_size: int
    zero_point: bool
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]
    #: Writes the float32 values of ``blocks`` into ``out`` ``[n, block_size]`` in place
    #: (the hot formats, without temporaries); None: ``dequantize_blocks`` then a copy.
    fill: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` weights (``cols`` must be whole blocks)."""
        return cols // self.block_size * self.type_size

    def dequantize(self, data: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Dequantize rows ``data`` ``uint8 [rows, row_bytes]`` into ``out`` ``[rows, cols]``.

        ``out`` (contiguous) may have any float dtype: values are computed in float32 and
        rounded once. Q4_0, Q4_1 and Q8_0 into float32 or bfloat16 on the CPU go through the
        engine's C++ loop (``native/gguf_dequant.cpp``, ~10x the torch ops' speed, the same
        values) where it is built.
        """
        blocks = data.reshape(-1, self.type_size)
        target = out.view(-1, self.block_size)
        if _native_dequant(self.qtype, blocks, out):
            return out
        if self.fill is None:
            target.copy_(self.dequantize_blocks(blocks))
        elif out.dtype == torch.float32:
            self.fill(blocks, target)
        else:
            from engine.kernels.gguf.scratch import scratch

            values = scratch(target.numel(), torch.float32, out.device).view(target.shape)
            self.fill(blocks, values)
            target.copy_(values)
        return out


#: Every format the engine keeps packed, by ggml type name.
FORMATS: dict[str, GGUFFormat] = {
    f.name: f for f in (
        GGUFFormat("F32", 0, 1, 4, False, dequantize_f32),
        GGUFFormat("F16", 1, 1, 2, False, dequantize_f16),
        GGUFFormat("Q4_0", 2, 32, 18, False, dequantize_q4_0, fill_q4_0),
        GGUFFormat("Q4_1", 3, 32, 20, True, dequantize_q4_1, fill_q4_1),
        GGUFFormat("Q5_0", 6, 32, 22, False, dequantize_q5_0),
        GGUFFormat("Q5_1", 7, 32, 24, True, dequantize_q5_1),
        GGUFFormat("Q8_0", 8, 32, 34, False, dequantize_q8_0, fill_q8_0),
        GGUFFormat("Q4_K", 12, QK_K, 144, True, dequantize_q4_k),
        GGUFFormat("Q5_K", 13, QK_K, 176, True, dequantize_q5_k),
        GGUFFormat("Q6_K", 14, QK_K, 210, False, dequantize_q6_k),
        GGUFFormat("BF16", 30, 1, 2, False, dequantize_bf16),
    )
}


def gguf_format(name: str) -> GGUFFormat:
    """The format named ``name``.

    Raises:
        KeyError: not a format the engine keeps packed (the message lists them).
    """
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"GGUF type {name} is not supported packed; supported: "
                       f"{', '.join(FORMATS)}") from None
