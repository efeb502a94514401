"""``Linear``: ``y = x W^T + b`` whose weights and matmul belong to a quantize method.

A layer may fuse several logical outputs (q, k and v; gate and up): the checkpoint has one
tensor per logical output ("shard"), stacked along the output dimension of the layer's
parameters in ``output_partition_sizes`` order. Loading a shard copies it into its rows.

Under tensor parallelism (``LayerInfo.parallel``; see ``engine.core.distributed.sharding``)
a layer holds its rank's part and the default loader narrows the full checkpoint tensor to
it (a parameter's ``weight_loader``, when it has one, does that itself)::

    column: checkpoint shard s [full_s, in] -> rows output_slices[s] -> param rows of s
    row:    checkpoint [out, in]            -> columns input_slice   -> param
    y = apply(x)            column: this rank's outputs, no communication
    y = all_reduce(apply(x, bias on rank 0 only))          row
    logits = gather_to_driver(apply(x))[..., :vocab]       the LM head (rank 0's result)

Checkpoint tensors may be packed (several features per element): a slice in features is
scaled by ``tensor.shape[dim] / features`` when it divides evenly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.core.distributed import (
    SINGLE,
    Slice,
    TensorParallelGroup,
    all_reduce,
    gather_to_driver,
)
from engine.core.model_loader.checkpoint_dtype import for_parameter
from engine.sdk.capture import CaptureContext
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.quantization import LayerInfo, QuantizeMethod
from engine.sdk.support import Support


def copy_into_parameter(
    module: nn.Module, param_name: str, tensor: torch.Tensor, name: str
) -> None:
    """Copy checkpoint tensor ``name`` into ``module.<param_name>``, checking the shape."""
    param = getattr(module, param_name, None)
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"checkpoint tensor {name!r}: {type(module).__name__} has no "
                         f"parameter {param_name!r}")
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the "
                         f"model expects {tuple(param.shape)}")
    param.data.copy_(tensor)


@dataclass(frozen=True)
class LinearShards:
    """Where a rank's part of a layer sits in the full checkpoint tensors.

    Attributes:
        output_sizes: Features of each fused logical output in the checkpoint (all ranks).
        output_slices: This rank's features of each logical output (column-parallel; the
            whole output otherwise). A slice may run past the output (LM head padding).
        input_slice: This rank's input features (row-parallel; the whole input otherwise).
    """

    output_sizes: tuple[int, ...]
    output_slices: tuple[Slice, ...]
    input_slice: Slice

    @staticmethod
    def whole(input_size: int, output_sizes: tuple[int, ...]) -> LinearShards:
        """A replicated layer: every rank holds everything."""
        return LinearShards(output_sizes, tuple(Slice(0, n) for n in output_sizes),
                            Slice(0, input_size))


def narrow_features(tensor: torch.Tensor, dim: int, part: Slice, features: int) -> torch.Tensor:
    """``tensor``'s elements for features ``part`` of ``features`` along ``dim``.

    A slice past the end is cut at it (the rows beyond are padding the caller zeroes).

    Raises:
        ValueError: the tensor packs features so that ``part`` does not fall on elements.
    """
    units = tensor.shape[dim]
    end = min(part.start + part.size, features)
    start, stop = part.start * units, end * units
    if start % features or stop % features:
        raise ValueError(f"features [{part.start}, {end}) of {features} do not fall on whole "
                         f"elements of a dimension of {units}")
    start, stop = start // features, stop // features
    return tensor.narrow(dim, start, max(stop - start, 0))


def tensor_parallel_refusal(tp: TensorParallelGroup) -> Support:
    """A layer's answer to ``capture_support``: no under tensor parallelism, else yes."""
    if tp.is_parallel:
        return Support.no("its collective across the tensor-parallel ranks runs in Python")
    return Support.yes()


class UnquantizedLinearMethod(QuantizeMethod):
    """The default: a dense weight in the model dtype; the matmul is a linear kernel.

    The kernel is chosen per layer by ``info.linear_kernel_selector`` (priority order,
    ``--linear-kernel``, ``--disabled-kernels``).
    """

    kernel: LinearKernel

    def create_weights(self, layer: nn.Module, info: LayerInfo) -> None:
        config = LinearKernelConfig(
            scheme="unquantized", weight_dtype=info.params_dtype,
            act_dtype=info.params_dtype, input_size=info.input_size_per_partition,
            output_size=info.output_size_per_partition, has_bias=info.has_bias,
        )
        self.kernel = info.linear_kernel_selector(config)(config)
        weight = nn.Parameter(
            torch.empty(info.output_size_per_partition, info.input_size_per_partition,
                        dtype=getattr(torch, info.params_dtype)),
            requires_grad=False,
        )
        weight.output_dim = 0  # type: ignore[attr-defined]
        weight.input_dim = 1  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.kernel.process_weights_after_loading(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.kernel.apply(layer, x, bias)

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Yes: ``apply`` only calls the kernel, which the engine asks itself."""
        return Support.yes()


class Linear(nn.Module):
    """A (possibly fused, possibly sharded) linear layer; parameters come from its method.

    Args:
        info: Sizes (this rank's), parallel style, dtype and prefix (the quantize method
            sees the same object).
        quant_method: Creates the parameters and computes the output.
        shards: Where this rank's part lies in the checkpoint (default: everything).
        tp: The tensor-parallel group (row-parallel layers reduce over it).
        gather_size: Set on a column-parallel LM head: gather the outputs on rank 0 and
            keep the first ``gather_size`` (the vocabulary; the rest is padding).
    """

    #: Registered by the quantize method's ``create_weights`` (every built-in one names
    #: its weight so); a tied LM head assigns the embedding's here.
    weight: torch.Tensor

    def __init__(
        self, info: LayerInfo, quant_method: QuantizeMethod, *, shards: LinearShards | None = None,
        tp: TensorParallelGroup = SINGLE, gather_size: int | None = None,
    ) -> None:
        super().__init__()
        self.info = info
        self.prefix = info.prefix
        self.output_partition_sizes = info.output_partition_sizes
        self.shards = shards or LinearShards.whole(info.input_size, info.output_partition_sizes)
        self.tp = tp
        self.gather_size = gather_size
        self.quant_method = quant_method
        quant_method.create_weights(self, info)
        self.bias: nn.Parameter | None = None
        if info.has_bias:
            bias = nn.Parameter(
                torch.zeros(info.output_size_per_partition,
                            dtype=getattr(torch, info.params_dtype)),
                requires_grad=False,
            )
            bias.output_dim = 0  # type: ignore[attr-defined]
            self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.info.parallel != "row":
            out = self.quant_method.apply(self, x, self.bias)
        else:  # the bias is added once: on rank 0, before the sum
            out = all_reduce(self.quant_method.apply(
                self, x, self.bias if self.tp.is_driver else None), self.tp)
        if self.gather_size is not None and self.tp.is_parallel:
            out = gather_to_driver(out, self.tp)
            if self.tp.is_driver:
                out = out[..., : self.gather_size]
        return out

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Yes on one rank (the engine asks the quantize method and its kernel too)."""
        return tensor_parallel_refusal(self.tp)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy this rank's part of checkpoint ``tensor`` into ``param_name`` (shard ``shard``).

        ``tensor`` is the full checkpoint tensor: of logical output ``shard`` of a fused
        layer, or (``shard`` None) of the whole layer. A floating-point tensor reaches a
        floating-point parameter (and its ``weight_loader``) in the parameter's dtype, cast
        from the checkpoint's values (:mod:`engine.core.model_loader.checkpoint_dtype`).

        Raises:
            ValueError: unknown parameter, or a shape that does not fit, naming both shapes.
        """
        param = getattr(self, param_name, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{self.prefix} has no parameter {param_name!r} to load into")
        tensor = for_parameter(tensor, param)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)  # engine.sdk.quantization.WeightLoader's form
            return
        output_dim: Any = getattr(param, "output_dim", None)
        sizes = self.shards.output_sizes
        if shard is None and output_dim is not None and len(sizes) > 1:
            # One tensor for the whole fused layer: each logical output from its rows.
            start, total = 0, sum(sizes)
            for index, size in enumerate(sizes):
                part = narrow_features(tensor, output_dim, Slice(start, size), total)
                self._load_part(param, param_name, part, index)
                start += size
            return
        self._load_part(param, param_name, tensor, shard)

    def rank_part(self, tensor: torch.Tensor, shard: int | None, output_dim: int | None,
                  input_dim: int | None) -> tuple[torch.Tensor, int]:
        """This rank's part of checkpoint ``tensor`` (logical output ``shard``), unsharded.

        Returns:
            The narrowed view, and how many rows past it along ``output_dim`` are padding
            (the LM head's rows past the vocabulary, which the caller zeroes).
        """
        padding = 0
        if output_dim is not None and self.info.parallel == "column":
            index = shard or 0
            part, features = self.shards.output_slices[index], self.shards.output_sizes[index]
            narrowed = narrow_features(tensor, output_dim, part, features)
            if part.start + part.size > features:  # the LM head's rows past the vocab
                padding = part.size * tensor.shape[output_dim] // features - narrowed.shape[
                    output_dim]
            tensor = narrowed
        if input_dim is not None and self.info.parallel == "row":
            tensor = narrow_features(tensor, input_dim, self.shards.input_slice,
                                     self.info.input_size)
        return tensor, padding

    def _load_part(self, param: torch.Tensor, param_name: str, tensor: torch.Tensor,
                   shard: int | None) -> None:
        target = param.data
        output_dim: Any = getattr(param, "output_dim", None)
        input_dim: Any = getattr(param, "input_dim", None)
        if output_dim is not None and shard is not None:
            local = self.output_partition_sizes
            target = narrow_features(target, output_dim,
                                     Slice(sum(local[:shard]), local[shard]), sum(local))
        tensor, padding = self.rank_part(tensor, shard, output_dim, input_dim)
        if padding > 0:
            target.narrow(output_dim, tensor.shape[output_dim], padding).zero_()
            target = target.narrow(output_dim, 0, tensor.shape[output_dim])
        if target.shape != tensor.shape:
            where = f"{self.prefix}.{param_name}" + ("" if shard is None else f" shard {shard}")
            raise ValueError(
                f"checkpoint tensor for {where} has shape {tuple(tensor.shape)}, the layer "
                f"expects {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def process_weights_after_loading(self) -> None:
        """Let the quantize method repack what was loaded."""
        self.quant_method.process_weights_after_loading(self)
