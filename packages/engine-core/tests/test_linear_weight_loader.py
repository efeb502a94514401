"""A parameter's ``weight_loader`` is called as engine.sdk.quantization.WeightLoader says:
``(param, loaded_weight, shard_id)``, with ``shard_id`` None for an unfused layer."""

from __future__ import annotations

import torch

from engine.core.model_executor.layers.linear import Linear
from engine.sdk.quantization import LayerInfo, QuantizeMethod


class LoaderMethod(QuantizeMethod):
    """Registers ``weight`` with a loader written exactly to the WeightLoader protocol."""

    def __init__(self) -> None:
        self.calls: list[int | None] = []

    def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
        weight = torch.nn.Parameter(torch.zeros(info.output_size_per_partition,
                                                info.input_size_per_partition),
                                    requires_grad=False)

        def weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: int | None) -> None:  # no default: the protocol's form
            self.calls.append(shard_id)
            start = 0 if shard_id is None else sum(info.output_partition_sizes[:shard_id])
            param.data[start:start + loaded_weight.shape[0]].copy_(loaded_weight)

        weight.weight_loader = weight_loader  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight, bias)


def test_the_loader_gets_shard_none_for_an_unfused_layer() -> None:
    method = LoaderMethod()
    layer = Linear(LayerInfo("model.layers.0.mlp.down_proj", "linear", 4, 3, 4, (3,),
                             "float32"), method)
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    layer.load_weight("weight", tensor, None)
    assert method.calls == [None]
    assert torch.equal(layer.weight, tensor)


def test_the_loader_gets_the_shard_of_a_fused_layer() -> None:
    method = LoaderMethod()
    layer = Linear(LayerInfo("model.layers.0.mlp.gate_up_proj", "linear", 4, 4, 4, (2, 2),
                             "float32"), method)
    layer.load_weight("weight", torch.ones(2, 4), 1)
    assert method.calls == [1]
    assert layer.weight[2:].eq(1).all() and layer.weight[:2].eq(0).all()
