"""``gguf``: a GGUF file's weights kept in their block formats, multiplied by format kernels.

Selected by ``--quantization gguf`` on a ``.gguf`` model (see ``selection.py`` for the
default). The settings are built by the engine from the file, not read from JSON::

    {"quant_method": "gguf",
     "tensor_types": {"model.embed_tokens": "Q8_0",
                      "model.layers.0.self_attn.q_proj": "Q4_1", ...}}

(one entry per matrix, by Hugging Face module name; ``lm_head`` is absent when the
embedding is tied). Every linear layer, the LM head and the embedding get a method:

* linear / lm_head: ``weight`` ``uint8 [rows, cols / block * type_size]``, the GGUF rows of
  this rank (``output_dim`` 0, ``input_dim`` 1: the engine's loader narrows whole blocks;
  a row-parallel split that does not fall on blocks is refused when the layer is built).
  The matmul is a linear kernel for scheme ``"gguf"`` with ``weight_dtype`` the ggml type
  (``gguf_dequant`` runs every format; ``gguf_int4`` is the fused Q4_0/Q4_1/Q4_K path).
  A fused layer whose shards have different types (K-quant mixes: q/k ``Q4_K``, v
  ``Q6_K``) keeps one part per shard, each with its own kernel, outputs concatenated.
* embedding: the same bytes; a lookup gathers the rows and dequantizes only those.

A tied LM head shares the embedding's ``weight`` (the model assigns it), so the table is
held once.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.kernels.gguf.formats import FORMATS, GGUFFormat
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.errors import UnsupportedError, ValidationError
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.quantization import LayerInfo, QuantizationConfig, QuantizeMethod
from engine.sdk.support import Support

SCHEME = "gguf"

#: Fused layers of the Llama family (the engine's model) and the checkpoint modules in them.
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

EMBEDDING = "model.embed_tokens"


def kernel_config(fmt: GGUFFormat, info: LayerInfo, rows: int) -> LinearKernelConfig:
    """What a kernel must implement for ``rows`` outputs of ``info`` stored as ``fmt``."""
    return LinearKernelConfig(
        scheme=SCHEME, weight_dtype=fmt.name, act_dtype=info.params_dtype,
        input_size=info.input_size_per_partition, output_size=rows,
        group_size=fmt.block_size, has_bias=info.has_bias, zero_point=fmt.zero_point)


def _packed(rows: int, cols: int, fmt: GGUFFormat) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(rows, fmt.row_bytes(cols), dtype=torch.uint8),
                          requires_grad=False)
    weight.output_dim = 0  # type: ignore[attr-defined]
    weight.input_dim = 1  # type: ignore[attr-defined]
    return weight


def _check_blocks(info: LayerInfo, formats: tuple[GGUFFormat, ...]) -> None:
    """A row-parallel rank must hold whole blocks of every row."""
    if info.parallel != "row" or info.tp_size == 1:
        return
    cols = info.input_size_per_partition
    for fmt in formats:
        if cols % fmt.block_size:
            raise UnsupportedError(
                f"gguf: {info.prefix} splits its {info.input_size} inputs into "
                f"{info.tp_size} parts of {cols}, which are not whole {fmt.name} blocks of "
                f"{fmt.block_size}; use a tensor_parallel_size that keeps blocks whole, or "
                f"load the file dequantized (without --quantization gguf)")


class GGUFLinearMethod(QuantizeMethod):
    """A linear layer (or LM head) whose shards are stored in ``formats``."""

    def __init__(self, formats: tuple[GGUFFormat, ...]) -> None:
        self.formats = formats
        self.kernels: list[LinearKernel] = []

    @property
    def is_mixed(self) -> bool:
        """Whether the shards have different formats (one part per shard)."""
        return len(set(self.formats)) > 1

    def create_weights(self, layer: nn.Module, info: LayerInfo) -> None:
        _check_blocks(info, self.formats)
        cols = info.input_size_per_partition
        if not self.is_mixed:
            fmt = self.formats[0]
            layer.register_parameter("weight", _packed(info.output_size_per_partition, cols,
                                                       fmt))
            config = kernel_config(fmt, info, info.output_size_per_partition)
            self.kernels = [info.linear_kernel_selector(config)(config)]
            return
        parts = nn.ModuleList()
        for fmt, rows in zip(self.formats, info.output_partition_sizes, strict=True):
            part = nn.Module()
            part.register_parameter("weight", _packed(rows, cols, fmt))
            parts.append(part)
            config = kernel_config(fmt, info, rows)
            self.kernels.append(info.linear_kernel_selector(config)(config))
        layer.gguf_parts = parts
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        placeholder.weight_loader = _PartLoader(layer)  # type: ignore[attr-defined]
        layer.register_parameter("weight", placeholder)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.is_mixed:
            self.kernels[0].process_weights_after_loading(layer)
            return
        for kernel, part in zip(self.kernels, _parts(layer), strict=True):
            kernel.process_weights_after_loading(part)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.is_mixed:
            return self.kernels[0].apply(layer, x, bias)
        outputs, start = [], 0
        for kernel, part in zip(self.kernels, _parts(layer), strict=True):
            rows = kernel.config.output_size
            outputs.append(kernel.apply(part, x, None if bias is None
                                        else bias[start:start + rows]))
            start += rows
        return torch.cat(outputs, dim=-1)

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Its kernels answer (the engine asks them); mixed formats: CUDA graphs only.

        Shards of different formats are joined by ``torch.cat``.
        """
        if self.is_mixed and ctx.kind is not GraphKind.CUDA_GRAPHS:
            return Support.no("its shards of different formats are joined by torch.cat, which "
                              "the CPU step graph cannot replay")
        return Support.yes()


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"a GGUF part has no 'weight' tensor, got {weight!r}")
    return weight


def _parts(layer: nn.Module) -> nn.ModuleList:
    parts: nn.ModuleList = layer.gguf_parts  # type: ignore[assignment]
    return parts


class _PartLoader:
    """``weight_loader`` of a mixed-format fused layer: shard ``s`` goes to part ``s``."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, param: nn.Parameter, tensor: torch.Tensor,
                 shard: int | None = None) -> None:
        if shard is None:
            raise ValueError(f"{getattr(self.layer, 'prefix', 'a layer')}: GGUF shards of "
                             f"different types must be loaded one by one")
        rank_part = getattr(self.layer, "rank_part", None)
        target = _weight(_parts(self.layer)[shard])
        part, padding = (tensor, 0) if rank_part is None else rank_part(tensor, shard, 0, 1)
        if padding:
            target.data[part.shape[0]:].zero_()
        if target.data[:part.shape[0]].shape != part.shape:
            raise ValueError(f"GGUF shard {shard} has shape {tuple(part.shape)}, the layer "
                             f"expects {tuple(target.shape)}")
        target.data[:part.shape[0]].copy_(part)


class GGUFEmbeddingMethod(QuantizeMethod):
    """An embedding table stored as ``fmt``: lookups dequantize only the rows they read."""

    def __init__(self, fmt: GGUFFormat) -> None:
        self.fmt = fmt
        self.dtype = torch.float32

    def create_weights(self, layer: nn.Module, info: LayerInfo) -> None:
        self.dtype = getattr(torch, info.params_dtype)
        weight = nn.Parameter(torch.empty(info.input_size_per_partition,
                                          self.fmt.row_bytes(info.output_size),
                                          dtype=torch.uint8), requires_grad=False)
        layer.register_parameter("weight", weight)
        self.hidden_size = info.output_size

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        rows = weight.index_select(0, x.reshape(-1))
        out = torch.empty(rows.shape[0], self.hidden_size, dtype=self.dtype, device=x.device)
        self.fmt.dequantize(rows, out)
        return out.view(*x.shape, self.hidden_size)

    def capture_support(self, ctx: CaptureContext) -> Support:
        """CUDA graphs: torch ops without host synchronisation; never the CPU step graph."""
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return Support.yes()
        return Support.no("its lookup dequantizes rows in torch, which the CPU step graph "
                          "cannot replay")


class GGUFConfig(QuantizationConfig):
    """The ``gguf`` method (see the module docstring)."""

    name: ClassVar[str] = "gguf"
    reads_gguf_blocks: ClassVar[bool] = True

    def __init__(self, tensor_types: dict[str, GGUFFormat]) -> None:
        self.tensor_types = tensor_types

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        method = config.get("quant_method", cls.name)
        types = config.get("tensor_types")
        if method != cls.name or not types:
            raise ValidationError(
                "gguf keeps the weights of a GGUF file in their block formats, so the model "
                "must be a .gguf file (this checkpoint "
                + (f"is quantized with {method!r})" if method != cls.name else
                   "has no GGUF tensors)"), param="quantization")
        if not isinstance(types, dict):
            raise ValidationError(f"gguf tensor_types must map module names to GGUF types, got "
                                  f"{types!r}", param="tensor_types")
        unsupported = sorted({t for t in types.values() if t not in FORMATS})
        if unsupported:
            raise ValidationError(
                f"gguf cannot keep GGUF type(s) {', '.join(map(str, unsupported))} packed "
                f"(used by e.g. {next(k for k, t in types.items() if t in unsupported)}); "
                f"supported: {', '.join(FORMATS)}. Load the file without --quantization gguf "
                f"to dequantize it instead.", param="tensor_types")
        return cls({str(name): FORMATS[t] for name, t in types.items()})

    @classmethod
    def supported_act_dtypes(cls) -> list[str]:
        return ["bfloat16", "float16", "float32"]

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()  # the reference kernel is plain torch

    def _formats(self, layer: LayerInfo, prefix: str) -> tuple[GGUFFormat, ...]:
        if prefix in self.tensor_types:
            return (self.tensor_types[prefix],)
        if layer.kind == "lm_head" and EMBEDDING in self.tensor_types:
            return (self.tensor_types[EMBEDDING],)  # tied to the embedding
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{shard}" for shard in FUSED_MODULES.get(leaf, ())]
        if names and all(n in self.tensor_types for n in names) and len(names) == len(
                layer.output_partition_sizes):
            return tuple(self.tensor_types[n] for n in names)
        known = ", ".join(f"{fused}={'+'.join(parts)}" for fused, parts in FUSED_MODULES.items())
        raise UnsupportedError(f"gguf: the model's layer {prefix} ({layer.kind}) has no tensor "
                               f"in the GGUF file (fused layers known: {known})")

    def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
        if layer.kind == "embedding":
            return GGUFEmbeddingMethod(self._formats(layer, prefix)[0])
        if layer.kind in ("linear", "lm_head"):
            return GGUFLinearMethod(self._formats(layer, prefix))
        return None
