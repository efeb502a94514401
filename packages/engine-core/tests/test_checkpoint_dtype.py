"""A quantized layer's float32 parameters get the checkpoint's float32 values in a bf16 model.

The weight iterator hands ``load_weights`` every floating-point tensor in the model dtype
(models rely on it); a quantize method's parameter of another floating dtype is loaded from
the checkpoint's own values, cast once to that dtype, through ``Linear.load_weight`` and
through a parameter's ``weight_loader`` alike. Integer tensors are never cast.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.core.model_executor.layers import Linear
from engine.core.model_loader import iter_safetensors_weights
from engine.sdk.quantization import LayerInfo, QuantizeMethod

SIZES = (4, 2)  # two fused logical outputs (think q and kv)
IN = 8
# Not representable in bfloat16 (8 mantissa bits): the cast rounds 1 + 2**-10 to 1.
FINE = 1 + 2 ** -10


class ScaledInt8(QuantizeMethod):
    """int8 weights, a float32 scale per output row, and a float32 per-shard input scale."""

    def __init__(self) -> None:
        self.loader_dtypes: list[torch.dtype] = []

    def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
        out = info.output_size_per_partition
        weight = torch.nn.Parameter(torch.zeros(out, IN, dtype=torch.int8), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1  # type: ignore[attr-defined]
        scale = torch.nn.Parameter(torch.zeros(out, dtype=torch.float32), requires_grad=False)
        scale.output_dim = 0  # type: ignore[attr-defined]
        input_scale = torch.nn.Parameter(torch.zeros(len(SIZES), dtype=torch.float32),
                                         requires_grad=False)

        def load_input_scale(param: torch.Tensor, tensor: torch.Tensor, shard: int | None
                             ) -> None:
            self.loader_dtypes.append(tensor.dtype)
            param.data[shard or 0] = tensor[0]

        input_scale.weight_loader = load_input_scale  # type: ignore[attr-defined]
        for name, param in (("weight", weight), ("weight_scale", scale),
                            ("input_scale", input_scale)):
            layer.register_parameter(name, param)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError  # loading only


def checkpoint(tmp_path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard, (name, size) in enumerate(zip(("q_proj", "kv_proj"), SIZES, strict=True)):
        tensors[f"{name}.weight"] = torch.arange(size * IN, dtype=torch.int8).view(size, IN)
        tensors[f"{name}.weight_scale"] = torch.full((size,), FINE * (shard + 1))
        tensors[f"{name}.input_scale"] = torch.tensor([FINE + shard])
    save_file(tensors, tmp_path / "model.safetensors")
    return tensors


def load(tmp_path: Path, *, keep: bool) -> tuple[Linear, ScaledInt8]:
    method = ScaledInt8()
    layer = Linear(LayerInfo(prefix="qkv", kind="linear", input_size=IN, output_size=sum(SIZES),
                             input_size_per_partition=IN, output_partition_sizes=SIZES,
                             params_dtype="bfloat16"), method)
    for name, tensor in iter_safetensors_weights(tmp_path, torch.bfloat16, progress=False,
                                                 keep_checkpoint_tensors=keep):
        module, param_name = name.split(".")
        assert tensor.dtype == (torch.int8 if param_name == "weight" else torch.bfloat16)
        layer.load_weight(param_name, tensor, 0 if module == "q_proj" else 1)
    return layer, method


def test_float32_parameters_get_the_checkpoints_values(tmp_path: Path) -> None:
    stored = checkpoint(tmp_path)
    layer, method = load(tmp_path, keep=True)  # what the worker does with quantization
    assert torch.equal(layer.weight, torch.cat([stored["q_proj.weight"],
                                                stored["kv_proj.weight"]]))
    assert layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight_scale, torch.cat([stored["q_proj.weight_scale"],
                                                      stored["kv_proj.weight_scale"]]))
    assert method.loader_dtypes == [torch.float32, torch.float32]  # the weight_loader's view
    assert torch.equal(layer.input_scale, torch.tensor([FINE, FINE + 1]))


def test_without_the_checkpoint_tensors_values_come_from_the_model_dtype(
        tmp_path: Path) -> None:
    """A model that derives tensors (or an unquantized load) passes bf16-rounded values."""
    checkpoint(tmp_path)
    layer, method = load(tmp_path, keep=False)
    assert torch.equal(layer.weight_scale[:4], torch.ones(4))  # FINE rounded to 1
    assert method.loader_dtypes == [torch.float32, torch.float32]  # cast to the parameter's
