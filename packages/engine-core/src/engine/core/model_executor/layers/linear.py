"""``Linear``: ``y = x W^T + b`` whose weights and matmul belong to a quantize method.

A layer may fuse several logical outputs (q, k and v; gate and up): the checkpoint has one
tensor per logical output ("shard"), stacked along the output dimension of the layer's
parameters in ``output_partition_sizes`` order. Loading a shard copies it into its rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.quantization import LayerInfo, QuantizeMethod


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


class Linear(nn.Module):
    """A (possibly fused) linear layer; parameters come from its quantize method.

    Args:
        info: Sizes, dtype and prefix (the quantize method sees the same object).
        quant_method: Creates the parameters and computes the output.
    """

    def __init__(self, info: LayerInfo, quant_method: QuantizeMethod) -> None:
        super().__init__()
        self.info = info
        self.prefix = info.prefix
        self.output_partition_sizes = info.output_partition_sizes
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
        return self.quant_method.apply(self, x, self.bias)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy checkpoint ``tensor`` into parameter ``param_name`` (shard ``shard`` of it).

        Raises:
            ValueError: unknown parameter, or a shape that does not fit, naming both shapes.
        """
        param = getattr(self, param_name, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{self.prefix} has no parameter {param_name!r} to load into")
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            return
        target = param.data
        output_dim: Any = getattr(param, "output_dim", None)
        if shard is not None and output_dim is not None:
            offset = sum(self.output_partition_sizes[:shard])
            target = target.narrow(output_dim, offset, self.output_partition_sizes[shard])
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
