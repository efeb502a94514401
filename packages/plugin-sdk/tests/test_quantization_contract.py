"""The quantization contract: config parsing, support checks, and a per-channel int8 method."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

from engine.sdk._version import __version__
from engine.sdk.errors import UnsupportedError, ValidationError
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig, select_linear_kernel
from engine.sdk.platform import PlatformInfo
from engine.sdk.quantization import (
    LayerInfo,
    QuantizationConfig,
    QuantizeMethod,
    check_quantization_support,
)
from engine.sdk.support import Support

CPU = PlatformInfo(name="cpu", device_type="cpu")
NPU = PlatformInfo(name="my_npu", device_type="npu")


def params(layer: torch.nn.Module) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    weight, scale = layer.weight, layer.weight_scale
    assert isinstance(weight, torch.nn.Parameter) and isinstance(scale, torch.nn.Parameter)
    return weight, scale


class TorchInt8Kernel(LinearKernel):
    name = "torch_int8"

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if config.scheme != "int8_w8a8" or config.group_size is not None:
            return Support.no("only channelwise int8_w8a8")
        return Support.yes()

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight, scale = params(layer)
        return torch.nn.functional.linear(x, weight.to(x.dtype) * scale.to(x.dtype)[:, None], bias)


class Int8LinearMethod(QuantizeMethod):
    def __init__(self) -> None:
        self.kernel: LinearKernel | None = None  # None: dequantize in apply() (no kernel)

    def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
        out, inp = info.output_size_per_partition, info.input_size_per_partition
        weight = torch.nn.Parameter(torch.empty(out, inp, dtype=torch.int8), requires_grad=False)
        scale = torch.nn.Parameter(torch.empty(out), requires_grad=False)
        for param in (weight, scale):
            param.output_dim = 0  # type: ignore[attr-defined]
        weight.input_dim = 1  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)
        config = LinearKernelConfig(
            scheme="int8_w8a8", weight_dtype="int8", act_dtype=info.params_dtype,
            input_size=inp, output_size=out, has_bias=info.has_bias,
        )
        try:
            self.kernel = info.linear_kernel_selector(config)(config)
        except UnsupportedError:
            self.kernel = None

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.apply(layer, x, bias)
        weight, scale = params(layer)
        return torch.nn.functional.linear(x, (weight.float() * scale[:, None]).to(x.dtype), bias)


class Int8Config(QuantizationConfig):
    name = "test_int8"

    def __init__(self, skip: tuple[str, ...]) -> None:
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8Config:
        skip = config.get("modules_to_not_convert", [])
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValidationError(
                f"modules_to_not_convert must be a list of strings, got {skip!r}",
                param="modules_to_not_convert",
            )
        return cls(tuple(skip))

    @classmethod
    def supported_act_dtypes(cls) -> list[str]:
        return ["bfloat16", "float32"]

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        if platform.device_type not in ("cpu", "cuda"):
            return Support.no(f"runs on cpu and cuda only, found {platform.device_type}")
        return Support.yes()

    def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
        if layer.kind != "linear" or any(s in prefix for s in self.skip):
            return None
        return Int8LinearMethod()


def make_info(**changes: Any) -> LayerInfo:
    base = LayerInfo(
        prefix="model.layers.0.mlp.down_proj", kind="linear", input_size=8, output_size=6,
        input_size_per_partition=8, output_partition_sizes=(6,), params_dtype="float32",
    )
    return dataclasses.replace(base, **changes)


def load(param: torch.nn.Parameter, full: torch.Tensor, info: LayerInfo) -> None:
    """The engine's default loader, as the module docstring describes it (column-parallel)."""
    dim = getattr(param, "output_dim", None)
    if dim is not None and info.parallel == "column":
        size = param.shape[dim]
        full = full.narrow(dim, info.tp_rank * size, size)
    param.data.copy_(full)


def test_from_config_parses_and_validates() -> None:
    assert Int8Config.from_config({"modules_to_not_convert": ["lm_head"]}).skip == ("lm_head",)
    assert Int8Config.from_config({}).skip == ()
    with pytest.raises(ValidationError) as info:
        Int8Config.from_config({"modules_to_not_convert": "lm_head"})
    assert info.value.param == "modules_to_not_convert"
    assert Int8Config.config_filenames() == []


def test_support_check_reports_platform_and_dtype_before_loading() -> None:
    assert check_quantization_support(Int8Config, CPU, "float32").ok
    no_npu = check_quantization_support(Int8Config, NPU, "float32")
    assert not no_npu and no_npu.reason == "runs on cpu and cuda only, found npu"
    no_fp16 = check_quantization_support(Int8Config, CPU, "float16")
    assert no_fp16.reason == (
        "activation dtype float16 is not supported; supported: bfloat16, float32"
    )


def test_support_check_catches_abstract_and_sloppy_classes() -> None:
    class Unfinished(QuantizationConfig):
        name = "unfinished"

    answer = check_quantization_support(Unfinished, CPU, "float32")  # type: ignore[type-abstract]
    assert not answer and "from_config" in answer.reason and "get_quant_method" in answer.reason
    with pytest.raises(TypeError, match="abstract"):
        Unfinished()  # type: ignore[abstract]

    class Sloppy(Int8Config):
        @classmethod
        def is_supported(cls, platform: PlatformInfo) -> Support:
            return None  # type: ignore[return-value]

    with pytest.raises(TypeError, match="is_supported\\(\\) must return"):
        check_quantization_support(Sloppy, CPU, "float32")


def test_get_quant_method_leaves_some_layers_unquantized() -> None:
    config = Int8Config.from_config({"modules_to_not_convert": ["mlp.gate"]})
    assert isinstance(config.get_quant_method(make_info(), "model.layers.0.mlp.down_proj"),
                      Int8LinearMethod)
    gate = make_info(prefix="model.layers.0.mlp.gate_proj")
    assert config.get_quant_method(gate, gate.prefix) is None
    emb = make_info(kind="embedding", prefix="model.embed_tokens")
    assert config.get_quant_method(emb, emb.prefix) is None


@pytest.mark.parametrize("use_selector", [False, True])
def test_int8_method_lifecycle_on_a_column_parallel_shard(use_selector: bool) -> None:
    torch.manual_seed(0)
    full_weight = torch.randint(-127, 128, (12, 8), dtype=torch.int8)
    full_scale = torch.rand(12) / 100
    calls: list[LinearKernelConfig] = []

    def selector(config: LinearKernelConfig) -> type[LinearKernel]:
        calls.append(config)
        return select_linear_kernel([TorchInt8Kernel], CPU, config)

    info = make_info(output_size=12, output_partition_sizes=(6,), tp_rank=1, tp_size=2,
                     parallel="column")
    if use_selector:
        info = dataclasses.replace(info, linear_kernel_selector=selector)
    method = Int8Config.from_config({}).get_quant_method(info, info.prefix)
    assert method is not None
    layer = torch.nn.Module()
    method.create_weights(layer, info)
    assert layer.weight.shape == (6, 8) and not layer.weight.requires_grad
    weight, scale = params(layer)
    load(weight, full_weight, info)
    load(scale, full_scale, info)
    method.process_weights_after_loading(layer)  # default: nothing
    x = torch.randn(3, 8)
    bias = torch.randn(6)
    expected = x @ (full_weight[6:].float() * full_scale[6:, None]).T + bias
    torch.testing.assert_close(method.apply(layer, x, bias), expected)
    assert [c.scheme for c in calls] == (["int8_w8a8"] if use_selector else [])


def test_layer_info_validation_and_derived_sizes() -> None:
    qkv = make_info(prefix="qkv_proj", output_size=48, output_partition_sizes=(16, 4, 4),
                    tp_size=2, parallel="column")
    assert qkv.output_size_per_partition == 24
    with pytest.raises(ValueError, match="kind must be one of"):
        make_info(kind="conv")
    with pytest.raises(ValueError, match="parallel must be one of"):
        make_info(parallel="diagonal")
    with pytest.raises(ValueError, match="sizes must be positive"):
        make_info(output_partition_sizes=())
    with pytest.raises(ValueError, match="tp_rank"):
        make_info(tp_rank=2, tp_size=2)


def test_default_kernel_selector_explains_itself() -> None:
    config = LinearKernelConfig(scheme="int8_w8a8", weight_dtype="int8", act_dtype="float32",
                                input_size=8, output_size=6)
    with pytest.raises(UnsupportedError, match="no linear kernel selector in this LayerInfo"):
        make_info().linear_kernel_selector(config)


def test_layer_info_selector_does_not_affect_equality_or_hash() -> None:
    selector = functools.partial(select_linear_kernel, [TorchInt8Kernel], CPU)
    with_selector = make_info(linear_kernel_selector=selector)
    assert with_selector == make_info()
    assert hash(with_selector) == hash(make_info())
    assert "linear_kernel_selector" not in repr(with_selector)


def test_quantize_method_abstract_methods_are_enforced() -> None:
    class NoApply(QuantizeMethod):
        def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
            pass

    with pytest.raises(TypeError, match="apply"):
        NoApply()  # type: ignore[abstract]


def test_sdk_version_is_recorded() -> None:
    assert Int8Config.sdk_version == __version__
