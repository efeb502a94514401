"""``--generation-config``: the model creator's default sampling parameters.

As in vLLM, a checkpoint's ``generation_config.json`` gives the defaults of the sampling
parameters a request leaves unset: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, and ``max_new_tokens`` (the default ``max_tokens``). Other keys
(``do_sample``, ``eos_token_id``, ...) are ignored. ``--generation-config`` chooses:

* ``auto`` (default): the model folder's ``generation_config.json``, if it has one;
* ``vllm``: none; the engine's own defaults (vLLM's name for them);
* a folder: its ``generation_config.json`` (which must exist).

The values apply the same way under ``engine serve`` (fields missing from the request),
``engine generate`` (sampling flags not given) and ``LLM.generate``/``LLM.chat`` (when no
``sampling_params`` are passed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.core.model_loader.loader import ModelSource
from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"

#: ``generation_config.json`` key -> ``SamplingParams`` field.
GENERATION_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}
_INTEGER_KEYS = {"top_k", "max_new_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """Default sampling parameters, and the file they came from.

    Attributes:
        values: ``SamplingParams`` field -> value (empty: the engine's own defaults).
        path: The ``generation_config.json`` read, or None.
    """

    values: Mapping[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def get(self, name: str, value: Any, fallback: Any) -> Any:
        """``value`` if it is set (not None), else this default for ``name``, else ``fallback``."""
        if value is not None:
            return value
        return self.values.get(name, fallback)

    def sampling_params(self, given: Mapping[str, Any] | None = None,
                        fallback: Mapping[str, Any] | None = None) -> SamplingParams:
        """``SamplingParams``: ``given`` over these defaults over ``fallback``.

        ``given`` values that are None count as unset; ``fallback`` holds a caller's own
        defaults (``engine generate``'s greedy default); ``SamplingParams``' own fill the rest.
        """
        chosen = {key: value for key, value in (given or {}).items() if value is not None}
        return SamplingParams(**{**(fallback or {}), **self.values, **chosen})

    def describe(self) -> str:
        """One line for the log, e.g. ``temperature=0.6, top_p=0.9 (from .../g.json)``."""
        values = ", ".join(f"{key}={value}" for key, value in self.values.items())
        return f"{values} (from {self.path})"


def _read(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValidationError(f"cannot read {file}: {exc}", param="generation_config") from exc
    if not isinstance(data, dict):
        raise ValidationError(f"{file} must hold a JSON object, got {type(data).__name__}",
                              param="generation_config")
    return data


def _checked(file: Path, data: Mapping[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, name in GENERATION_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        kinds = (int,) if key in _INTEGER_KEYS else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "an integer" if key in _INTEGER_KEYS else "a number"
            raise ValidationError(f"{file}: {key} must be {kind}, got {value!r}",
                                  param="generation_config")
        values[name] = value
    try:
        SamplingParams(**values)
    except ValidationError as exc:
        raise ValidationError(f"{file} holds a sampling parameter out of range: {exc} "
                              f"(--generation-config vllm ignores the file)",
                              param="generation_config") from None
    return values


def load_generation_defaults(source: ModelSource, generation_config: str) -> GenerationDefaults:
    """The default sampling parameters ``--generation-config`` selects.

    Args:
        source: The model (``auto`` reads its folder's ``generation_config.json``).
        generation_config: ``auto``, ``vllm``, or a folder path.

    Raises:
        ValidationError: the folder does not exist or has no ``generation_config.json``,
            the file is not a JSON object, or a value has the wrong type or range.
    """
    if generation_config == "vllm":
        return GenerationDefaults()
    if generation_config == "auto":
        file = source.path / GENERATION_CONFIG_FILE
        if not file.is_file():
            return GenerationDefaults()
    else:
        folder = Path(generation_config).expanduser()
        file = folder / GENERATION_CONFIG_FILE
        if not file.is_file():
            what = "has no generation_config.json" if folder.is_dir() else "is not a folder"
            raise ValidationError(
                f"--generation-config {generation_config!r} {what}; pass auto (the model's "
                f"generation_config.json), vllm (the engine's own defaults) or a folder that "
                f"holds a generation_config.json", param="generation_config")
    values = _checked(file, _read(file))
    return GenerationDefaults(values, file.resolve() if values else None)
