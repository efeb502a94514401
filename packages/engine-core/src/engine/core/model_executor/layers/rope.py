"""RoPE frequencies, including the scaled variants checkpoints declare.

Supported ``rope_type`` values: ``default``, ``linear``, ``llama3``, ``dynamic`` is
refused with an error (its frequencies depend on the sequence length). The settings come
from :func:`engine.sdk.layers.rope_settings`, which reads transformers 4.x (``rope_theta``
+ ``rope_scaling``) and 5.x (``rope_parameters``) configs, for built-in and plugin models
alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inv_frequencies(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """``[rotary_dim / 2]`` float32 inverse frequencies for ``params`` (see module doc).

    Raises:
        ValueError: an unsupported rope type, naming the supported ones.
    """
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    inv_freq: torch.Tensor = torch.pow(float(base), exponents).reciprocal()
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq.div(float(params["factor"]))
    if rope_type == "llama3":
        return _llama3(inv_freq, params)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
