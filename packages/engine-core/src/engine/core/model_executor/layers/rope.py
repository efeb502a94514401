"""RoPE frequencies and cos/sin caches, including the scaled variants checkpoints declare.

The settings come from :func:`engine.sdk.layers.rope_settings`, which reads transformers
4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``) configs, for built-in
and plugin models alike. Each type follows transformers' ``ROPE_INIT_FUNCTIONS``
(``modeling_rope_utils``) to the formula, keys and defaults; ``max_position`` below is the
cache's length, the config's ``max_position_embeddings`` (``LayerFactory.rotary_embedding``):

* ``default``; ``linear`` (``factor``); ``llama3`` (``factor``, ``low_freq_factor``,
  ``high_freq_factor``, ``original_max_position_embeddings``).
* ``yarn`` (Qwen2.5/Qwen3 long context, DeepSeek, GPT-OSS): ``factor`` (``None``:
  ``max_position / original_max_position_embeddings``), ``original_max_position_embeddings``,
  optional ``beta_fast`` (32), ``beta_slow`` (1), ``truncate`` (True), ``attention_factor``
  (else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given,
  else ``0.1 * ln(factor) + 1``). The attention factor multiplies the cache's cosines and
  sines. (DeepSeek's extra softmax scale from ``mscale_all_dim`` is the model's business.)
* ``longrope`` (4.x configs of Phi-3: also ``su``; Phi-3/3.5/4-mini 128k):
  ``short_factor`` and ``long_factor`` (``rotary_dim / 2`` numbers each),
  ``original_max_position_embeddings``, optional ``attention_factor`` (else
  ``sqrt(1 + ln(factor) / ln(original))`` with ``factor`` the key or ``max_position /
  original``; 1 when ``factor <= 1``). *Which* factors: transformers chooses per forward
  pass, long when the pass's largest position is ``>= original``, so a sequence that grows
  past ``original`` switches sets while its cached keys keep the short rotation. The engine
  serves one cache from a static rule, vLLM V1's: the long factors for every position when
  the engine's ``max_model_len`` exceeds ``original_max_position_embeddings``, else the short
  ones (``max_model_len`` absent: ``max_position``). It gives transformers' outputs for a
  sequence that stays within ``original`` when ``max_model_len <= original``, and for one
  whose prompt is already longer than ``original`` when ``max_model_len > original``; it
  differs for short sequences served with a longer ``max_model_len`` (long factors here,
  short in transformers) and for sequences that cross ``original`` while generating (one
  set throughout here). Serve with ``--max-model-len`` at most ``original`` to get the
  short factors.
* ``dynamic`` (NTK): transformers rescales the base only for sequences longer than
  ``max_position_embeddings``, which the engine never serves (``max_model_len`` is at most
  that, and the cache covers ``max_position``), so within the cache its frequencies are the
  default ones, exactly. ``factor`` is required as transformers requires it. (vLLM instead
  rescales for every sequence, and differs from transformers for them all.)

An unknown ``rope_type`` is a ``ValueError`` naming the supported ones; a missing key a
``KeyError`` naming the type, the key and the supported types.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from engine.sdk.ops import RotaryEmbeddingOp

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
#: Older names transformers 4.x configs use, read as the type they stand for.
ROPE_TYPE_ALIASES = {"su": "longrope"}


class MissingRopeKey(KeyError):
    """A key the rope type needs is missing (printed as the message, unquoted)."""

    def __str__(self) -> str:
        return str(self.args[0])


class RopeFrequencies(NamedTuple):
    """What a cos/sin cache is made of."""

    #: ``[rotary_dim / 2]`` float32 inverse frequencies.
    inv_freq: torch.Tensor
    #: Multiplies the cosines and sines (YaRN's and LongRoPE's attention factor; else 1).
    attention_factor: float


def rope_frequencies(rotary_dim: int, params: dict[str, Any], max_position: int,
                     max_model_len: int | None = None) -> RopeFrequencies:
    """The inverse frequencies and the attention factor for ``params`` (see module doc).

    Args:
        rotary_dim: Rotating elements per head.
        params: Rope settings (``rope_settings``): ``rope_type``, ``rope_theta``, the
            type's keys.
        max_position: The config's ``max_position_embeddings``: YaRN's and LongRoPE's
            default ``factor`` is ``max_position / original_max_position_embeddings``.
        max_model_len: The longest sequence the engine serves (LongRoPE's choice of
            factors); ``None``: ``max_position``.

    Raises:
        ValueError: an unsupported rope type (naming the supported ones), or a LongRoPE
            factor list of the wrong length.
        MissingRopeKey: a key the type needs is missing (a ``KeyError``).
    """
    rope_type = ROPE_TYPE_ALIASES.get(params["rope_type"], params["rope_type"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    inv_freq: torch.Tensor = torch.pow(base, exponents).reciprocal()
    if rope_type == "linear":
        return RopeFrequencies(inv_freq.div(float(_need(params, "factor"))), 1.0)
    if rope_type == "llama3":
        return RopeFrequencies(_llama3(inv_freq, params), 1.0)
    if rope_type == "yarn":
        return _yarn(base, rotary_dim, params, max_position)
    if rope_type == "longrope":
        return _longrope(base, exponents, params, max_position, max_model_len or max_position)
    if rope_type == "dynamic":
        _need(params, "factor")  # no effect within max_position (module doc)
    return RopeFrequencies(inv_freq, 1.0)


def inv_frequencies(rotary_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """``[rotary_dim / 2]`` float32 inverse frequencies for ``params``, without the factor."""
    return rope_frequencies(rotary_dim, params, max_position).inv_freq


def cos_sin_cache(rotary_dim: int, max_position: int, params: dict[str, Any],
                  max_model_len: int | None = None) -> torch.Tensor:
    """The ``[max_position, rotary_dim]`` cache ``RotaryEmbeddingOp`` takes, for ``params``.

    ``RotaryEmbeddingOp.default_cos_sin_cache`` of the frequencies, times the attention
    factor (as transformers multiplies its cos and sin); see :func:`rope_frequencies`.
    """
    inv_freq, attention_factor = rope_frequencies(rotary_dim, params, max_position,
                                                  max_model_len)
    cache = RotaryEmbeddingOp.default_cos_sin_cache(rotary_dim, max_position, inv_freq=inv_freq)
    return cache if attention_factor == 1.0 else cache * attention_factor


def _need(params: dict[str, Any], key: str) -> Any:
    """``params[key]``, or an error naming the type, the key and the supported types."""
    if key not in params:
        raise MissingRopeKey(
            f"rope_type {params['rope_type']!r} needs {key!r} in the rope settings (got "
            f"{', '.join(sorted(params))}); supported types: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return params[key]


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    factor = float(_need(params, "factor"))
    low_freq_factor = float(_need(params, "low_freq_factor"))
    high_freq_factor = float(_need(params, "high_freq_factor"))
    old_context = float(_need(params, "original_max_position_embeddings"))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, params: dict[str, Any], max_position: int
          ) -> RopeFrequencies:
    # Interpolate (divide by `factor`) the dimensions that rotate fewer than `beta_slow`
    # times over the original context, keep those rotating more than `beta_fast` times,
    # and blend linearly in between.
    original = float(_need(params, "original_max_position_embeddings"))
    factor = params.get("factor")
    factor = max_position / original if factor is None else float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = (_yarn_mscale(factor, float(mscale))
                                / _yarn_mscale(factor, float(mscale_all_dim)))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_share = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = (interpolation * (1 - extrapolation_share)
                + extrapolation * extrapolation_share)
    return RopeFrequencies(inv_freq, float(attention_factor))


def _longrope(base: float, exponents: torch.Tensor, params: dict[str, Any],
              max_position: int, max_model_len: int) -> RopeFrequencies:
    # Per-dimension rescale factors: one set for sequences within the original context,
    # one beyond it; which one the engine uses is a static rule (module doc).
    original = int(_need(params, "original_max_position_embeddings"))
    short_factor, long_factor = _need(params, "short_factor"), _need(params, "long_factor")
    for key, factors in (("short_factor", short_factor), ("long_factor", long_factor)):
        if len(factors) != exponents.numel():
            raise ValueError(f"rope_type {params['rope_type']!r}: {key} must have "
                             f"rotary_dim / 2 = {exponents.numel()} numbers, got "
                             f"{len(factors)}")
    factor = params.get("factor")
    factor = max_position / original if factor is None else float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    chosen = long_factor if max_model_len > original else short_factor
    ext_factors = torch.tensor(chosen, dtype=torch.float32)
    inv_freq = 1.0 / (ext_factors * base**exponents)
    return RopeFrequencies(inv_freq, float(attention_factor))
