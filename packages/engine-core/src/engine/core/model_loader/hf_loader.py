"""Loading a local Hugging Face checkpoint directory: ``config.json`` and ``*.safetensors``.

A directory holds either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {name: file}}``). Only safetensors are read:
``pytorch_model.bin`` (pickle) is refused with a message saying so. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from engine.core.model_loader.checkpoint_dtype import cast_weight
from engine.sdk.errors import ValidationError

SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_hf_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """Load ``config.json`` from a local directory (never from the Hub).

    Args:
        path: The checkpoint directory.

    Returns:
        The ``transformers`` config (e.g. ``LlamaConfig``).

    Raises:
        ValidationError: The directory has no ``config.json``.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValidationError(f"{folder} has no config.json", param="model")
    config: PretrainedConfig = AutoConfig.from_pretrained(folder, local_files_only=True)
    return config


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint directory, in load order.

    With ``model.safetensors.index.json`` the files it names (each once, sorted); without,
    every ``*.safetensors`` in the directory, sorted.

    Raises:
        ValidationError: There are no safetensors files, or the index names a missing file.
    """
    folder = Path(path)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValidationError(
                f"{index} names shards that are missing: {', '.join(missing)}", param="model"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt")
        )
        hint = (
            f" (found {', '.join(other)}: only safetensors are loaded; convert with "
            f"transformers: model.save_pretrained(dir, safe_serialization=True))"
            if other
            else ""
        )
        raise ValidationError(f"{folder} has no *.safetensors weights{hint}", param="model")
    return files


def iter_safetensors_weights(
    path: str | os.PathLike[str], dtype: torch.dtype, *, progress: bool = True,
    keep_checkpoint_tensors: bool = False,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(name, tensor)`` for every tensor of a checkpoint directory.

    Args:
        path: The checkpoint directory.
        dtype: Floating-point tensors are cast to it; integer tensors (e.g. packed
            quantized weights) are yielded unchanged.
        progress: Show a tqdm progress bar (one step per tensor) on stderr.
        keep_checkpoint_tensors: A cast tensor keeps the stored one, so that a layer
            loads a parameter of another floating dtype from the stored values
            (:mod:`engine.core.model_loader.checkpoint_dtype`; with quantization).

    Yields:
        Names as stored in the files (e.g. ``model.layers.0.self_attn.q_proj.weight``) and
        CPU tensors.

    Raises:
        ValidationError: See :func:`safetensors_files`.
    """
    files = safetensors_files(path)
    # safetensors' stub leaves safe_open's methods untyped.
    handles: list[Any] = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(
        total=total, desc=f"Loading {Path(path).name}", unit="tensor", disable=not progress
    ) as bar:
        for handle in handles:
            for name in handle.keys():
                tensor: torch.Tensor = handle.get_tensor(name)
                bar.update(1)
                yield name, cast_weight(tensor, dtype, keep_original=keep_checkpoint_tensors)
