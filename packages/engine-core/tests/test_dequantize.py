"""Dequantization of every storage type the loader relies on, against independent references.

* Types ``gguf`` can quantize in Python (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): random
  data is quantized with ``gguf.quants.quantize``, written to a GGUF file, read back through
  the loader, and compared exactly with a numpy decoder written here from llama.cpp's block
  layouts, and loosely with the original data.
* K-quants (``gguf`` cannot quantize them in Python, and the SmolLM2 file has none: it holds
  F32, Q8_0 and Q4_1 only): random raw blocks are decoded by a transcription of llama.cpp's
  ``dequantize_row_q4_K`` / ``dequantize_row_q6_K`` loops.
* Real tensors of the SmolLM2 file (Q8_0, Q4_1, F32) against the numpy decoders.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.core.model_loader import default_model_path, dequantize_tensor
from engine.core.model_loader._gguf_reader import open_gguf

ROWS, COLS = 8, 512


def f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Elements 0..15 in the low nibbles, 16..31 in the high ones (ggml's 32-blocks)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def high_bits(qh: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(qh).view(np.uint32)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.float32)


def ref_q8_0(b: np.ndarray) -> np.ndarray:
    y: np.ndarray = f16(b[:, :2]) * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)
    return y


def ref_q4_0(b: np.ndarray) -> np.ndarray:
    y: np.ndarray = f16(b[:, :2]) * (nibbles(b[:, 2:]) - 8)
    return y


def ref_q4_1(b: np.ndarray) -> np.ndarray:
    y: np.ndarray = f16(b[:, :2]) * nibbles(b[:, 4:]) + f16(b[:, 2:4])
    return y


def ref_q5_0(b: np.ndarray) -> np.ndarray:
    y: np.ndarray = f16(b[:, :2]) * (nibbles(b[:, 6:]) + 16 * high_bits(b[:, 2:6]) - 16)
    return y


def ref_q5_1(b: np.ndarray) -> np.ndarray:
    y: np.ndarray = f16(b[:, :2]) * (nibbles(b[:, 8:]) + 16 * high_bits(b[:, 4:8])) + f16(b[:, 2:4])
    return y


REFERENCES = {
    QT.Q8_0: ref_q8_0,
    QT.Q4_0: ref_q4_0,
    QT.Q4_1: ref_q4_1,
    QT.Q5_0: ref_q5_0,
    QT.Q5_1: ref_q5_1,
}
# Largest acceptable RMS error, relative to the data's RMS, of a round trip.
TOLERANCE = {QT.Q8_0: 0.01, QT.Q5_0: 0.05, QT.Q5_1: 0.05, QT.Q4_0: 0.1, QT.Q4_1: 0.1}


def reference(raw: np.ndarray, qtype: QT) -> np.ndarray:
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, type_size)
    return REFERENCES[qtype](blocks).reshape(raw.shape[0], -1)


def write(path: Path, tensors: dict[str, tuple[np.ndarray, QT | None]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_back(path: Path) -> dict[str, torch.Tensor]:
    return {t.name: dequantize_tensor(t) for t in open_gguf(path).tensors}


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    values[:, :32] *= 10  # blocks with different scales
    values[0, 32:64] = 0.0  # an all-zero block
    return values


@pytest.mark.parametrize("qtype", list(REFERENCES))
def test_block_quant_round_trip(tmp_path: Path, data: np.ndarray, qtype: QT) -> None:
    raw = gguf.quants.quantize(data, qtype)
    path = write(tmp_path / "q.gguf", {"w": (raw, qtype)})
    loaded = read_back(path)["w"]
    assert loaded.dtype == torch.float32
    assert tuple(loaded.shape) == (ROWS, COLS)
    np.testing.assert_array_equal(loaded.numpy(), reference(raw, qtype))
    error = np.sqrt(np.mean((loaded.numpy() - data) ** 2) / np.mean(data**2))
    assert error < TOLERANCE[qtype]
    assert np.all(loaded.numpy()[0, 32:64] == 0.0)


def test_float_types_round_trip(tmp_path: Path, data: np.ndarray) -> None:
    path = write(
        tmp_path / "f.gguf",
        {
            "f32": (data, None),
            "f16": (data.astype(np.float16), None),
            "bf16": (gguf.quants.quantize(data, QT.BF16), QT.BF16),
            "f64": (data.astype(np.float64), None),
            "vector": (data[0], None),
        },
    )
    loaded = read_back(path)
    assert all(tuple(t.shape) == (ROWS, COLS) for k, t in loaded.items() if k != "vector")
    assert torch.equal(loaded["f32"], torch.from_numpy(data))
    assert torch.equal(loaded["f16"], torch.from_numpy(data).half().float())
    # Round to nearest even, as torch does.
    assert torch.equal(loaded["bf16"], torch.from_numpy(data).bfloat16().float())
    assert torch.equal(loaded["f64"], torch.from_numpy(data))
    assert torch.equal(loaded["vector"], torch.from_numpy(data[0]))
    assert loaded["f32"].numpy().flags.writeable  # a copy, not the read-only mapping


# -- K-quants: transcriptions of llama.cpp's ggml-quants.c -------------------------------------

QK_K = 256


def scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return (
        int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
        int((q[j + 4] >> 4) | ((q[j] >> 6) << 4)),
    )


def dequantize_row_q4_k(block: np.ndarray) -> list[np.float32]:
    d, dmin = f16(block[0:2])[0], f16(block[2:4])[0]
    scales, qs = block[4:16], block[16:144]
    y: list[np.float32] = []
    for chunk in range(QK_K // 64):
        sc1, m1 = scale_min_k4(2 * chunk, scales)
        sc2, m2 = scale_min_k4(2 * chunk + 1, scales)
        d1, min1 = d * np.float32(sc1), dmin * np.float32(m1)
        d2, min2 = d * np.float32(sc2), dmin * np.float32(m2)
        q = qs[32 * chunk : 32 * chunk + 32]
        y += [d1 * np.float32(v & 0xF) - min1 for v in q]
        y += [d2 * np.float32(v >> 4) - min2 for v in q]
    return y


def dequantize_row_q6_k(block: np.ndarray) -> list[np.float32]:
    ql, qh = block[0:128], block[128:192]
    sc = block[192:208].view(np.int8)
    d = f16(block[208:210])[0]
    y = [np.float32(0)] * QK_K
    for half in range(2):
        lo, hi, s = ql[64 * half :], qh[32 * half :], sc[8 * half :]
        for col in range(32):
            sub = col // 16
            q1 = int((lo[col] & 0xF) | (((hi[col] >> 0) & 3) << 4)) - 32
            q2 = int((lo[col + 32] & 0xF) | (((hi[col] >> 2) & 3) << 4)) - 32
            q3 = int((lo[col] >> 4) | (((hi[col] >> 4) & 3) << 4)) - 32
            q4 = int((lo[col + 32] >> 4) | (((hi[col] >> 6) & 3) << 4)) - 32
            for offset, q, k in ((0, q1, 0), (32, q2, 2), (64, q3, 4), (96, q4, 6)):
                y[128 * half + col + offset] = d * np.float32(s[sub + k]) * np.float32(q)
    return y


def random_k_blocks(qtype: QT, rows: int, blocks_per_row: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.1, size=(rows * blocks_per_row, 2)).astype(np.float16)
    if qtype == QT.Q4_K:
        raw[:, 0:4] = scale.view(np.uint8)  # d, dmin
    else:
        raw[:, 208:210] = scale[:, :1].view(np.uint8)  # d
    return raw.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize(
    ("qtype", "row_decoder"), [(QT.Q4_K, dequantize_row_q4_k), (QT.Q6_K, dequantize_row_q6_k)]
)
def test_k_quants_match_llama_cpp(tmp_path: Path, qtype: QT, row_decoder: object) -> None:
    rows, blocks_per_row = 3, 2
    raw = random_k_blocks(qtype, rows, blocks_per_row)
    path = write(tmp_path / "k.gguf", {"w": (raw, qtype)})
    loaded = read_back(path)["w"]
    assert tuple(loaded.shape) == (rows, blocks_per_row * QK_K)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    expected = np.array(
        [v for block in raw.reshape(-1, type_size) for v in row_decoder(block)],  # type: ignore[operator]
        dtype=np.float32,
    ).reshape(rows, -1)
    np.testing.assert_array_equal(loaded.numpy(), expected)


# -- the real file -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "qtype"),
    [
        ("token_embd.weight", QT.Q8_0),
        ("blk.0.attn_v.weight", QT.Q4_1),
        ("blk.29.ffn_down.weight", QT.Q4_1),
    ],
)
def test_smollm2_tensors_match_numpy_reference(name: str, qtype: QT) -> None:
    tensor = {t.name: t for t in open_gguf(default_model_path()).tensors}[name]
    assert tensor.tensor_type == qtype
    loaded = dequantize_tensor(tensor)
    assert tuple(loaded.shape) == tuple(reversed(tensor.shape.tolist()))
    np.testing.assert_array_equal(loaded.numpy(), reference(np.asarray(tensor.data), qtype))


def test_smollm2_f32_tensor_is_copied_verbatim() -> None:
    tensor = {t.name: t for t in open_gguf(default_model_path()).tensors}["output_norm.weight"]
    assert tensor.tensor_type == QT.F32
    loaded = dequantize_tensor(tensor)
    assert tuple(loaded.shape) == (576,)
    np.testing.assert_array_equal(loaded.numpy(), np.asarray(tensor.data))
