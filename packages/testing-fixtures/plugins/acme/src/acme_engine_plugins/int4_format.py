"""The ``acme_int4`` weight format: quantize, pack, unpack; write a quantized checkpoint.

Used by the ``acme_int4`` method's kernel (:func:`dequantize`) and by whoever prepares a
checkpoint for it (:func:`quantize_checkpoint`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

#: Checkpoint tensors that stay unquantized: embeddings, norms, the LM head.
QUANTIZED_SUFFIXES = ("_proj.weight",)


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float -> (``qweight`` uint8 ``[out, in/2]``, ``scales`` float32).

    Symmetric per group of ``group_size`` inputs: ``scale = max|w| / 7``, ``q =
    clamp(round(w / scale), -8, 7)``.
    """
    out, inp = weight.shape
    if inp % group_size or group_size % 2:
        raise ValueError(f"input features {inp} must be whole groups of an even "
                         f"group_size, got {group_size}")
    groups = weight.float().reshape(out, inp // group_size, group_size)
    scales = groups.abs().amax(-1).clamp(min=1e-8) / 7.0
    q = torch.round(groups / scales[..., None]).clamp(-8, 7).to(torch.int16).reshape(out, inp)
    return pack(q), scales


def pack(q: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` integers in ``[-8, 7]`` -> ``uint8 [out, in / 2]`` (even input low)."""
    nibbles = (q + 8).to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    """``uint8 [out, in / 2]`` -> int8 ``[out, in]`` values in ``[-8, 7]``."""
    low = (qweight & 0x0F).to(torch.int8) - 8
    high = (qweight >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(qweight.shape[0], -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out, in]`` weight the packed values and scales stand for, in ``dtype``."""
    values = unpack(qweight).float()
    group_size = values.shape[1] // scales.shape[1]
    weight = values.reshape(values.shape[0], scales.shape[1], group_size) * scales.float()[
        ..., None]
    return weight.reshape(values.shape).to(dtype)


def quantize_checkpoint(source: Path, target: Path, group_size: int = 32, *,
                        dequantized: Path | None = None) -> Path:
    """Write ``source`` (a safetensors HF checkpoint) quantized to ``acme_int4`` at ``target``.

    Every ``*_proj.weight`` becomes ``*_proj.qweight`` and ``*_proj.scales``; the rest is
    copied. With ``dequantized``, also writes there the unquantized checkpoint whose
    projections are exactly the dequantized int4 weights (a reference for accuracy tests).
    """
    from safetensors.torch import load_file, save_file

    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for file in sorted(Path(source).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name.endswith(QUANTIZED_SUFFIXES) and tensor.dim() == 2:
                qweight, scales = quantize(tensor, group_size)
                base = name.removesuffix(".weight")
                quantized[f"{base}.qweight"], quantized[f"{base}.scales"] = qweight, scales
                reference[name] = dequantize(qweight, scales, tensor.dtype)
            else:
                quantized[name] = reference[name] = tensor
    for out, tensors, settings in ((target, quantized, True), (dequantized, reference, False)):
        if out is None:
            continue
        out.mkdir(parents=True, exist_ok=True)
        for extra in Path(source).iterdir():
            if extra.is_file() and extra.suffix != ".safetensors":
                shutil.copy(extra, out / extra.name)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        if settings:
            config = json.loads((out / "config.json").read_text())
            config["quantization_config"] = {"quant_method": "acme_int4",
                                             "group_size": group_size}
            (out / "config.json").write_text(json.dumps(config, indent=2))
    return target
