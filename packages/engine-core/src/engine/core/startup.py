"""Everything the engine decides before it loads weights, in one place.

``prepare(config)`` builds the plugin catalog (and runs general plugins), selects the
platform and lets it adjust the config, resolves the model and reads its config, picks the
dtype, the context length and the quantization method (checked here, before any weight
loads, so the front end reports an unknown or unsupported method first). The result is
shared by the front end, EngineCore and the worker (in other processes it is rebuilt from
the same config and manifest).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.config import EngineConfig
from engine.core.custom_op_selection import CustomOpSettings, resolve_settings
from engine.core.distributed import check_tensor_parallel
from engine.core.model_loader import (
    GenerationDefaults,
    ModelSource,
    load_config,
    load_generation_defaults,
    resolve_model,
)
from engine.core.model_selection import ModelChoice, architectures_of, choose_model
from engine.core.platforms import select_platform
from engine.core.plugin_options import check_option_targets, check_plugin_options
from engine.core.plugins import Allowlist, PluginCatalog, PluginManifest, set_catalog
from engine.core.quantization import QuantizationSelection, resolve_quantization
from engine.core.vllm_options import check_kv_cache_dtype, log_option_notes
from engine.sdk.errors import ValidationError
from engine.sdk.groups import WORKER_EXTENSIONS
from engine.sdk.platform import Platform, PlatformConfig
from engine.sdk.quantization import QuantizationConfig

logger = logging.getLogger("engine")

#: The token budget where neither the operator nor the platform chose one.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
#: Tokens per KV-cache block where neither the operator nor the platform chose a size.
DEFAULT_BLOCK_SIZE = 16

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class EngineSetup:
    """The resolved pieces an engine is built from."""

    config: EngineConfig
    catalog: PluginCatalog
    manifest: PluginManifest
    platform: type[Platform]
    source: ModelSource
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    attention_backend: str | None
    #: Tokens per KV-cache block: the platform's ``block_size`` (it starts from
    #: ``--block-size``, ``None`` when not given), else ``--block-size``, else
    #: ``DEFAULT_BLOCK_SIZE``.
    block_size: int
    #: ``--worker-extension`` names, then those the platform added.
    worker_extensions: tuple[str, ...] = ()
    #: The model class that serves the checkpoint (``--model-impl``); None only in a
    #: setup built by hand.
    model: ModelChoice | None = None
    #: The platform's ``custom_ops`` items, then ``--custom-ops`` (which wins).
    custom_ops: CustomOpSettings = field(default_factory=CustomOpSettings)
    #: ``--enforce-eager`` or the platform's ``enforce_eager`` (either one disables graphs).
    enforce_eager: bool = False
    #: The quantization method (``--quantization`` or the checkpoint's), checked and
    #: configured in this process; None: unquantized.
    quantization: QuantizationSelection | None = None
    #: Default sampling parameters (``--generation-config``) of requests that leave them unset.
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    #: The token budget of one step: ``--max-num-batched-tokens``, else the platform's
    #: choice, else ``DEFAULT_MAX_NUM_BATCHED_TOKENS`` (see ``resolve_token_budget``).
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

    @property
    def quant_config(self) -> QuantizationConfig | None:
        """The quantization method's configuration (what the layer factory asks), or None."""
        return None if self.quantization is None else self.quantization.config

    @property
    def keeps_gguf_blocks(self) -> bool:
        """Whether a GGUF file's matrices are loaded packed (the ``gguf`` method)."""
        return self.quantization is not None and self.quantization.keeps_gguf_blocks

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding table (logits columns)."""
        return int(self.hf_config.vocab_size)


def resolve_dtype(requested: str, hf_config: Any, source: ModelSource,
                  platform: type[Platform]) -> torch.dtype:
    """The model dtype: the operator's choice, or a default for ``auto``.

    ``auto``: float32 checkpoints stay float32; otherwise the platform's preferred dtype
    (bfloat16 on CPUs with native bf16, else float32).
    """
    if requested != "auto":
        return _TORCH_DTYPES[requested]
    preferred = platform.supported_dtypes()[0]
    # transformers 5 names it ``dtype`` (reading ``torch_dtype`` warns); 4.x ``torch_dtype``.
    declared = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    declared = str(declared).removeprefix("torch.") if declared is not None else None
    if source.kind == "hf" and declared == "float32":
        return torch.float32
    return _TORCH_DTYPES.get(preferred, torch.float32)


def resolve_token_budget(config: EngineConfig, platform_choice: int | None, platform: str,
                         max_model_len: int) -> int:
    """The token budget: the operator's, else the platform's, else the default.

    Without chunked prefill a prompt must fit one step, so a budget the operator did not
    give is raised to ``max_model_len`` (as vLLM does); one the operator gave is kept (the
    scheduler refuses it with the reason).

    Raises:
        ValidationError: the platform chose a budget below 1.
    """
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    if platform_choice is not None and (isinstance(platform_choice, bool) or not isinstance(
            platform_choice, int) or platform_choice < 1):
        raise ValidationError(f"platform {platform} set max_num_batched_tokens to "
                              f"{platform_choice!r}; it must be an int >= 1",
                              param="max_num_batched_tokens")
    budget = platform_choice or DEFAULT_MAX_NUM_BATCHED_TOKENS
    return budget if config.enable_chunked_prefill else max(budget, max_model_len)


def resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    """``--max-model-len`` if given (never above the model's), else the model's length."""
    model_len = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    if requested is None:
        return model_len
    if requested > model_len:
        raise ValidationError(
            f"max_model_len {requested} exceeds the model's context length {model_len}",
            param="max_model_len",
        )
    return requested


def prepare(config: EngineConfig, *, process: str = "frontend") -> EngineSetup:
    """Resolve plugins, platform, model config, dtype and context length."""
    catalog = PluginCatalog.discover(Allowlist.from_env(config.plugins))
    set_catalog(catalog)
    check_option_targets(config, catalog)  # unknown, skipped or ambiguous names
    catalog.run_general_plugins()
    manifest = PluginManifest.from_catalog(catalog)
    platform = select_platform(catalog)
    available = platform.is_available()
    if not available.ok:
        raise ValidationError(f"platform {platform.name} is not available: {available.reason}")
    platform_config = PlatformConfig(dtype=config.dtype, block_size=config.block_size,
                                     worker_extensions=list(config.worker_extensions),
                                     attention_backend=config.attention_backend,
                                     custom_ops=list(config.custom_ops),
                                     enforce_eager=config.enforce_eager,
                                     max_num_batched_tokens=config.max_num_batched_tokens)
    platform.check_and_update_config(platform_config)
    custom_ops = resolve_settings(config.custom_ops, platform_config.custom_ops,
                                  platform.name, catalog)  # bad op names fail here
    for name in platform_config.worker_extensions:  # unknown names fail before any load
        catalog.resolve(WORKER_EXTENSIONS, name)
    source = resolve_model(config.model, load_format=config.load_format,
                           tokenizer=config.tokenizer)
    hf_config = load_config(source)
    check_tensor_parallel(hf_config, config.tensor_parallel_size, platform)
    dtype = resolve_dtype(platform_config.dtype or "auto", hf_config, source, platform)
    check_kv_cache_dtype(config.kv_cache_dtype, str(dtype).removeprefix("torch."))
    quantization = resolve_quantization(config.quantization, catalog, source, platform,
                                        str(dtype).removeprefix("torch."))  # before any load
    max_model_len = resolve_max_model_len(config.max_model_len, hf_config)
    # After the checks above, which say what is wrong with the config first.
    model = choose_model(catalog, architectures_of(hf_config), config.model_impl)
    if len(model.candidates) > 1 and process == "frontend":
        logger.info("model %s: %s (%s) [%s]; candidates: %s", model.architecture,
                    model.entry.value, model.entry.provider, model.reason,
                    ", ".join(f"{e.value} ({e.provider})" for e in model.candidates))
    setup = EngineSetup(
        config=config, catalog=catalog, manifest=manifest, platform=platform, source=source,
        hf_config=hf_config, dtype=dtype, max_model_len=max_model_len,
        max_num_batched_tokens=resolve_token_budget(config, platform_config.max_num_batched_tokens,
                                                    platform.name, max_model_len),
        attention_backend=platform_config.attention_backend,
        block_size=platform_config.block_size or config.block_size or DEFAULT_BLOCK_SIZE,
        worker_extensions=tuple(dict.fromkeys(platform_config.worker_extensions)),
        model=model, custom_ops=custom_ops,
        enforce_eager=config.enforce_eager or bool(platform_config.enforce_eager),
        quantization=quantization,
        generation_defaults=load_generation_defaults(source, config.generation_config),
    )
    if process == "frontend":  # every --plugin-option value, before any weight loads
        check_plugin_options(setup)
        log_option_notes(setup)  # vLLM options that change nothing here, and why
    logger.info("%s: model %s (%s), platform %s, dtype %s, max_model_len %d%s", process,
                source.display_name, source.kind, platform.name,
                str(dtype).removeprefix("torch."), setup.max_model_len,
                "" if quantization is None else
                f", quantization {quantization.name} (from {quantization.origin})")
    return setup
