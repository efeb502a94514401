"""Rope settings from a transformers config of either era (exported by ``engine.sdk.layers``).

transformers 4.x spreads them over ``config.rope_theta``, ``config.rope_scaling`` (``None``
when unscaled; the type under ``type`` or ``rope_type``) and, for some models,
``config.partial_rotary_factor``. transformers 5 gathers them in ``config.rope_parameters``
(and has no ``rope_theta`` attribute); a model whose layer types use different settings
(Gemma 3) has one such dict per layer type there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The base when a config gives none (transformers' default).
DEFAULT_ROPE_THETA = 10000.0
#: Scaling types that need the pretraining context (``original_max_position_embeddings``).
_NEED_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope", "su")


def rope_settings(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of a transformers config, as ``LayerFactory.rotary_embedding`` takes them.

    Reads a config of either transformers era: 5.x's ``config.rope_parameters``, or 4.x's
    ``config.rope_theta``, ``config.rope_scaling`` and ``config.partial_rotary_factor`` (an
    object with those attributes will do)::

        rope = rope_settings(ctx.hf_config)
        rotary_dim = int(head_size * rope.get("partial_rotary_factor", 1.0))
        self.rotary = ctx.layers.rotary_embedding(
            head_size, rotary_dim, cfg.max_position_embeddings, rope)

    Args:
        config: The model's config (``ModelContext.hf_config``).
        layer_type: For a config whose rope settings differ per layer type (5.x
            ``rope_parameters`` such as ``{"full_attention": {...}, "sliding_attention":
            {...}}``), the type to read; ignored for a config with one set of settings.

    Returns:
        A new dict: ``rope_type`` (``"default"`` when the config names none; 4.x's ``type``
        key is read as ``rope_type``), ``rope_theta`` (a float; 10000.0 when the config
        gives none), the scaling type's own keys as transformers spells them (``factor``,
        ``low_freq_factor``, ``original_max_position_embeddings``, ...), and
        ``partial_rotary_factor`` (a float) only when the config has one: rotate
        ``int(head_size * partial_rotary_factor)`` elements of each head. For the types
        ``llama3``, ``yarn`` and ``longrope`` (4.x: also ``su``),
        ``original_max_position_embeddings`` is filled in as transformers 5 does: the
        config's own attribute of that name first (Phi-3 keeps it there), else the
        settings' key, else the config's ``max_position_embeddings``.

    Raises:
        ValueError: the settings are per layer type and ``layer_type`` is not one of them
            (the message lists them).

    .. versionadded:: 1.1
    """
    settings = _for_layer(getattr(config, "rope_parameters", None), layer_type)
    for key, value in _for_layer(getattr(config, "rope_scaling", None), layer_type).items():
        settings.setdefault(key, value)
    legacy_type = settings.pop("type", None)
    settings.setdefault("rope_type", legacy_type or "default")
    theta = settings.get("rope_theta") or getattr(config, "rope_theta", None)
    settings["rope_theta"] = float(theta or DEFAULT_ROPE_THETA)
    factor = settings.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor is not None:
        settings["partial_rotary_factor"] = float(factor)
    if settings["rope_type"] in _NEED_ORIGINAL_CONTEXT:
        original = getattr(config, "original_max_position_embeddings", None)
        if original is None:
            original = settings.get("original_max_position_embeddings",
                                    getattr(config, "max_position_embeddings", None))
        if original is not None:
            settings["original_max_position_embeddings"] = original
    return settings


def _for_layer(value: Any, layer_type: str | None) -> dict[str, Any]:
    """``value`` as a new dict, or its entry for ``layer_type`` when it is one per type."""
    if not isinstance(value, Mapping):
        return {}
    per_type = bool(value) and all(isinstance(v, Mapping) for v in value.values())
    if not per_type:
        return dict(value)
    if layer_type in value:
        return dict(value[layer_type])
    raise ValueError(f"the config's rope settings differ per layer type "
                     f"({', '.join(map(str, value))}); pass layer_type= one of them, got "
                     f"{layer_type!r}")
