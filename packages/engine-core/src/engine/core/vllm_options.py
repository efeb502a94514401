"""vLLM's engine options that have no exact counterpart here, and what each does instead.

An operator's ``vllm serve`` command line or ``LLM(...)`` call should run unchanged. Each
option listed here either does the same thing (``--dtype half`` is ``float16``), or is
accepted and says in one log line what it would do and why it does not here
(``--trust-remote-code``, ``--gpu-memory-utilization``), or is refused with one message
that says what it would do, why it cannot here, and what is allowed (``--load-format pt``,
``--kv-cache-dtype fp8``). Never a silent no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.sdk.errors import ValidationError

if TYPE_CHECKING:
    from engine.core.config import EngineConfig
    from engine.core.startup import EngineSetup

logger = logging.getLogger("engine")

#: vLLM's ``--dtype`` spellings that name one of ours.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

#: vLLM load formats this engine does not read: format -> (what it would do, why not).
REFUSED_LOAD_FORMATS: dict[str, str] = {
    "pt": "would read PyTorch pickle files (*.bin, *.pt); only safetensors are read here, "
          "because unpickling a checkpoint can run arbitrary code (convert with "
          "transformers: model.save_pretrained(dir, safe_serialization=True))",
    "npcache": "would cache PyTorch pickle weights as numpy arrays; only safetensors are "
               "read here (they are memory-mapped already)",
    "bitsandbytes": "would quantize weights with bitsandbytes while loading; use "
                    "--quantization NAME with an engine.quantization method (e.g. int8)",
    "sharded_state": "would read per-rank shards saved by vLLM; this engine splits the full "
                     "checkpoint across ranks itself (--tensor-parallel-size)",
    "tensorizer": "would deserialize a CoreWeave tensorizer file; not supported here",
    "runai_streamer": "would stream safetensors from object storage; only local "
                      "directories are read here",
    "runai_streamer_sharded": "would stream per-rank shards from object storage; only "
                              "local directories are read here",
    "fastsafetensors": "would read safetensors with GPU direct storage; plain safetensors "
                       "(--load-format safetensors) read the same files",
    "mistral": "would read Mistral's consolidated.safetensors layout; pass a Hugging Face "
               "directory (config.json + model*.safetensors)",
}

#: KV-cache dtypes the attention backends here can keep.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")

_FP8_REASON = ("would store keys and values in 8-bit floats (half the memory of bfloat16); "
               "no attention backend here reads an 8-bit KV cache")
REFUSED_KV_CACHE_DTYPES = {name: _FP8_REASON for name in (
    "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")}


def _choose(option: str, value: Any, allowed: tuple[str, ...],
            refused: Mapping[str, str]) -> Any:
    if not isinstance(value, str):
        return value  # the field's own type check reports it
    if value in refused:
        raise ValueError(f"{option} {value!r} {refused[value]}; allowed: {', '.join(allowed)}")
    if value not in allowed:
        raise ValueError(f"{option} {value!r} is not one of: {', '.join(allowed)}")
    return value


def check_load_format(value: Any) -> Any:
    """``value`` if it is an accepted ``--load-format``.

    Raises:
        ValueError: a vLLM format this engine does not read (saying why), or an unknown one.
    """
    return _choose("load_format", value, LOAD_FORMATS, REFUSED_LOAD_FORMATS)


def check_kv_cache_dtype_name(value: Any) -> Any:
    """``value`` if it is an accepted ``--kv-cache-dtype`` (before the model dtype is known).

    Raises:
        ValueError: an fp8 cache (saying why not), or an unknown name.
    """
    return _choose("kv_cache_dtype", value, KV_CACHE_DTYPES, REFUSED_KV_CACHE_DTYPES)


def check_kv_cache_dtype(requested: str, model_dtype: str) -> None:
    """Refuse a ``--kv-cache-dtype`` other than ``auto`` or the model's dtype.

    Args:
        requested: ``EngineConfig.kv_cache_dtype``.
        model_dtype: The resolved model dtype, e.g. ``"bfloat16"``.

    Raises:
        ValidationError: the KV cache would need a dtype other than the model's.
    """
    if requested in ("auto", model_dtype):
        return
    raise ValidationError(
        f"--kv-cache-dtype {requested} would keep the KV cache in {requested} while the "
        f"model runs in {model_dtype}; the attention backends here keep it in the model's "
        f"dtype: use --kv-cache-dtype auto (or {model_dtype}), or --dtype {requested} to run "
        f"the whole model in {requested}", param="kv_cache_dtype")


def option_notes(config: EngineConfig, device_type: str) -> list[str]:
    """One line per accepted option that changes nothing here, saying why.

    Args:
        config: The engine's options.
        device_type: The platform's device type (``"cpu"``, ``"cuda"``, ...).
    """
    notes = []
    if config.trust_remote_code:
        notes.append(
            "--trust-remote-code: would let transformers run Python code shipped with the "
            "checkpoint (auto_map); this engine never runs checkpoint code: the model class "
            "is the engine.models entry named by config.json's architectures, so the flag "
            "changes nothing")
    utilization = config.gpu_memory_utilization
    explicit = ("--num-kv-blocks" if config.num_kv_blocks is not None else
                "--kv-cache-memory" if config.kv_cache_memory is not None else None)
    if utilization is not None and (device_type != "cuda" or explicit):
        where = (f"{explicit} is given and wins" if device_type == "cuda" else
                 f"on a {device_type.upper()} there is no GPU memory to take it from")
        notes.append(
            f"--gpu-memory-utilization {utilization:g}: would size the KV cache to fill that "
            f"fraction of GPU memory; {where}: the KV cache holds --kv-cache-memory GiB "
            f"(default 2) or --num-kv-blocks N blocks instead")
    return notes


def log_option_notes(setup: EngineSetup) -> None:
    """Log :func:`option_notes` and the model's default sampling parameters at WARNING.

    Called once, in the front end, before any weight loads.
    """
    for note in option_notes(setup.config, setup.platform.device_type):
        logger.warning("%s", note)
    defaults = setup.generation_defaults
    if defaults.values:
        logger.warning("default sampling parameters of requests that leave them unset: %s; "
                       "--generation-config vllm uses the engine's own defaults instead",
                       defaults.describe())
