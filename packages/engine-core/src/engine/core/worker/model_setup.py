"""Build the model a worker serves: resolve its class, its attention backend, its layers.

Everything here goes through the plugin catalog: the model class is the ``engine.models``
entry named by the checkpoint's architecture, the attention backend an
``engine.attention_backends`` entry, and custom-op replacements ``engine.custom_ops``
entries, so built-ins and plugins take exactly the same path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.core.custom_op_selection import CustomOpSettings, OpMeasure, select_custom_ops
from engine.core.distributed import SINGLE, TensorParallelGroup, head_slice
from engine.core.kernel_choice import KernelSelection
from engine.core.kernel_choice.attention_selection import measured_attention_backend
from engine.core.kernel_choice.op_selection import OpMeasurer, OpShape
from engine.core.kernel_choice.selection import make_selector
from engine.core.model_executor.layers import LayerFactory
from engine.core.model_loader.dummy import load_weights_into
from engine.core.model_selection import ModelChoice, architectures_of, choose_model
from engine.core.plugin_faults import guard_forward
from engine.core.plugin_options import validated_options
from engine.core.plugins import PluginCatalog
from engine.core.plugins._loader import plugin_error
from engine.core.plugins._precedence import ambiguity_error
from engine.core.worker.model_faults import naming_model, watched
from engine.sdk.attention import AttentionBackend, AttentionSpec, select_backend
from engine.sdk.errors import PluginError, UnsupportedError
from engine.sdk.groups import ATTENTION_BACKENDS, LINEAR_KERNELS, MODELS
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig, select_linear_kernel
from engine.sdk.model import ModelContext
from engine.sdk.ops import NATIVE, CustomOp
from engine.sdk.platform import Platform, PlatformInfo
from engine.sdk.plugin import PluginOptions
from engine.sdk.quantization import QuantizationConfig

#: The token budget measured for when none is given (the CPU platform's).
DEFAULT_STEP_TOKENS = 512
#: The backend that serves a model whose layer the platform's default backend refuses.
REFERENCE_BACKEND = "torch"


@dataclass(frozen=True)
class BuiltModel:
    """A model with its weights loaded, and the factory that built its layers."""

    model: nn.Module
    factory: LayerFactory
    backend: type[AttentionBackend]


def resolve_attention_backend(
    catalog: PluginCatalog, platform: type[Platform], spec: AttentionSpec, requested: str | None
) -> type[AttentionBackend]:
    """The backend for ``spec``: ``requested`` (``--attention-backend``) or the platform's.

    Raises:
        UnsupportedError: the backend cannot serve ``spec``, with its reason.
    """
    name = requested or platform.default_attention_backend(spec)
    cls: type[AttentionBackend] = catalog.load(ATTENTION_BACKENDS, name)
    try:
        return select_backend([cls], spec)
    except UnsupportedError as exc:
        hint = "" if requested else " (the platform's default)"
        raise UnsupportedError(
            f"attention backend {name!r}{hint} cannot serve this model ({spec.describe()})",
            exc.reasons,
        ) from None


def resolve_custom_ops(catalog: PluginCatalog, settings: CustomOpSettings | None = None,
                       dispatch_key: str = NATIVE, platform_info: PlatformInfo | None = None,
                       measure: OpMeasure | None = None) -> dict[str, type[CustomOp]]:
    """Replacement op classes in use (``--custom-ops`` and the platform), checked.

    See ``engine.core.custom_op_selection`` (``measure``: its measured default). Each is
    guarded (``engine.core.plugin_faults``): an exception in its ``forward`` fails the
    step's requests, naming the plugin.
    """
    platform = None if dispatch_key == NATIVE else platform_info
    selected = select_custom_ops(catalog, settings, dispatch_key, platform, measure)
    return {name: guard_forward(cls, functools.partial(plugin_error, entry))
            for name, (entry, cls) in selected.items()}


def _linear_kernels(catalog: PluginCatalog, forced: str | None
                    ) -> tuple[list[type[LinearKernel]], dict[str, PluginError], str | None,
                               dict[str, str]]:
    """The candidates, the names two third parties provide, the forced name, the providers.

    A name two third parties provide is an error only when the selection lands on it, so
    one of them stands in for it meanwhile. ``forced`` given as ``module:Class`` replaces
    the candidate of the same name (the engine's own one that a plugin shadows, say). The
    providers: per kernel name, its distribution and version.
    """
    kernels: list[type[LinearKernel]] = []
    ambiguous: dict[str, PluginError] = {}
    providers: dict[str, str] = {}
    for name in catalog.names(LINEAR_KERNELS):
        third_party = [e for e in catalog.candidates(LINEAR_KERNELS, name)
                       if not e.is_first_party]
        if len(third_party) > 1:
            ambiguous[name] = ambiguity_error(third_party, catalog.allowlist.source)
            entry = third_party[0]
        else:
            entry = catalog.resolve(LINEAR_KERNELS, name)
        kernels.append(catalog.load_resolved(entry))
        providers[name] = entry.provider
    if forced is not None and ":" in forced:
        chosen: type[LinearKernel] = catalog.load(LINEAR_KERNELS, forced)
        forced = chosen.name or forced
        ambiguous.pop(forced, None)
        kernels = [k for k in kernels if k.name != forced] + [chosen]
    return kernels, ambiguous, forced, providers


def make_linear_kernel_selector(
    catalog: PluginCatalog, platform: type[Platform], *, forced: str | None,
    disabled: Sequence[str], selection: KernelSelection = "priority",
    step_tokens: int = DEFAULT_STEP_TOKENS, step_graph: bool = True,
) -> Callable[[LinearKernelConfig], type[LinearKernel]]:
    """The per-layer linear kernel chooser over every allowed ``engine.linear_kernels`` entry.

    ``selection`` (``--kernel-selection``): ``priority`` takes the first kernel in priority
    order that can run a layer; ``measured`` times the ones that can on this machine
    (``engine.core.kernel_choice``) for steps of up to ``step_tokens`` tokens, those the CPU
    step graph records replayed from one where ``step_graph``.

    Raises:
        ValidationError: ``forced`` or a ``disabled`` name is not an installed kernel.
        PluginError: ``forced`` (a name) is provided by two third parties.
    """
    kernels, ambiguous, forced, providers = _linear_kernels(catalog, forced)
    if forced in ambiguous:
        raise ambiguous[forced]
    info = platform.info()
    measured = make_selector(selection, kernels, info, forced=forced, disabled=disabled,
                             step_tokens=step_tokens, versions=providers,
                             step_graph=step_graph)

    def selector(config: LinearKernelConfig) -> type[LinearKernel]:
        kernel = measured(config) if measured is not None else select_linear_kernel(
            kernels, info, config, forced=forced, disabled=tuple(disabled))
        for name in getattr(kernel, "classes", {kernel.name: kernel}):
            if name in ambiguous:  # the selection landed on a name two plugins provide
                raise ambiguous[name]
        return kernel

    probe = LinearKernelConfig(scheme="unquantized", weight_dtype="float32",
                               act_dtype="float32", input_size=1, output_size=1)
    try:  # surface unknown --linear-kernel / --disabled-kernels names before building
        select_linear_kernel(kernels, info, probe, forced=forced, disabled=tuple(disabled))
    except UnsupportedError:
        pass
    return selector


def probe_attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int,
                         tp_size: int = 1) -> AttentionSpec:
    """One rank's attention spec of a Llama-family config (for backend selection).

    A guess from the config's usual keys (``sliding_window``, Gemma 2's
    ``attn_logit_softcapping``); each layer's own spec is checked as the model builds it.

    With ``tp_size`` ranks a rank holds ``num_heads / tp_size`` query heads and its share
    of the KV heads (one replicated head when there are fewer KV heads than ranks).
    """
    num_heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    dtype_name = str(dtype).removeprefix("torch.")
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None
    return AttentionSpec(
        num_heads=num_heads // tp_size,
        num_kv_heads=head_slice(num_kv_heads, 0, tp_size).size,
        head_size=head_size, dtype=dtype_name, kv_cache_dtype=dtype_name,
        block_size=block_size, sliding_window=window,
        logits_soft_cap=getattr(hf_config, "attn_logit_softcapping", None),
    )


def build_model(
    *, catalog: PluginCatalog, platform: type[Platform], hf_config: Any, dtype: torch.dtype,
    block_size: int, attention_backend: str | None, weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device, linear_kernel: str | None = None, disabled_kernels: Sequence[str] = (),
    plugin_options: Mapping[str, Mapping[str, Any]] | None = None,
    tp: TensorParallelGroup = SINGLE, custom_ops: CustomOpSettings | None = None,
    quant_config: QuantizationConfig | None = None,
    model_choice: ModelChoice | None = None, kernel_selection: KernelSelection = "priority",
    step_tokens: int = DEFAULT_STEP_TOKENS, step_graph: bool = True,
    max_model_len: int | None = None,
) -> BuiltModel:
    """Construct the model on ``device``, load ``weights`` and return it in eval mode.

    ``plugin_options`` (``--plugin-option``) reach the model class and the attention
    backend through their ``Options`` models. With ``tp`` of several ranks the model holds
    rank ``tp.rank``'s shard; ``weights`` are the full checkpoint tensors (the layers'
    loaders narrow them). ``quant_config`` (``EngineSetup.quant_config``) gives every
    linear layer and the embedding its quantize method. ``model_choice`` is the model the
    front end chose (``EngineSetup.model``; default: ``choose_model`` with ``--model-impl
    auto``). ``kernel_selection``, ``step_tokens`` and ``step_graph`` (False under
    ``--enforce-eager``): see ``make_linear_kernel_selector``. ``max_model_len``
    (``EngineSetup.max_model_len``) reaches the layer factory (LongRoPE's choice of factors).
    """
    options = plugin_options or {}
    choice = model_choice or choose_model(catalog, architectures_of(hf_config))
    model_cls: type[nn.Module] = catalog.load_resolved(choice.entry)
    spec = probe_attention_spec(hf_config, dtype, block_size, tp.size)
    requested = attention_backend
    backend_name = attention_backend or platform.default_attention_backend(spec)
    if attention_backend is None and kernel_selection == "measured":
        measured = measured_attention_backend(catalog, platform, spec, dtype,
                                              default=backend_name, step_tokens=step_tokens,
                                              options=options)
        if measured != backend_name:
            attention_backend = backend_name = measured
    backend = resolve_attention_backend(catalog, platform, spec, attention_backend)
    factory = LayerFactory(
        dtype=dtype, block_size=block_size, attention_backend=backend,
        backend_options=validated_options(catalog, ATTENTION_BACKENDS, backend_name, backend,
                                          options),
        op_classes=resolve_custom_ops(
            catalog, custom_ops, platform.device_type, platform.info(),
            OpMeasurer(OpShape.of(hf_config, dtype), platform.device_type, step_tokens)
            if kernel_selection == "measured" and platform.device_type == "cpu" else None),
        dispatch_key=platform.device_type,
        linear_kernel_selector=make_linear_kernel_selector(
            catalog, platform, forced=linear_kernel, disabled=disabled_kernels,
            selection=kernel_selection, step_tokens=step_tokens, step_graph=step_graph),
        tp=tp, quant_config=quant_config, max_model_len=max_model_len,
        fallback_backend=None if requested else _reference_backend(catalog, options),
    )
    arch = choice.architecture
    ctx = ModelContext(plugin_name=arch, process="worker", hf_config=hf_config,
                       dtype=spec.dtype, layers=factory,
                       options=validated_options(catalog, MODELS, arch, model_cls, options,
                                                 entry=choice.entry))
    with naming_model(choice.entry, "constructing it"), torch.device(device):
        model = model_cls(ctx)
    with naming_model(choice.entry, "loading its weights (load_weights)") as loader_errors:
        # random ones for --load-format dummy
        load_weights_into(model, watched(weights, loader_errors))
    # The backend serving the layers: the selected one, or the fallback a layer moved to.
    return BuiltModel(model.eval(), factory, factory.attention_backend)


def _reference_backend(catalog: PluginCatalog, options: Mapping[str, Mapping[str, Any]]
                       ) -> tuple[type[AttentionBackend], PluginOptions] | None:
    """``torch``, with its options: where a layer refuses the platform's default backend."""
    try:
        cls: type[AttentionBackend] = catalog.load(ATTENTION_BACKENDS, REFERENCE_BACKEND)
    except PluginError:
        return None  # not allowed or shadowed badly: such a layer is then an error
    return cls, validated_options(catalog, ATTENTION_BACKENDS, REFERENCE_BACKEND, cls, options)
