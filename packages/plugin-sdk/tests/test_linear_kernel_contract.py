"""Linear-kernel selection: priority, ties, --linear-kernel, --disabled-kernels, reasons."""

from __future__ import annotations

import pytest
import torch

from engine.sdk._version import __version__
from engine.sdk.errors import UnsupportedError, ValidationError
from engine.sdk.linear_kernel import (
    DISABLED_REASON,
    LinearKernel,
    LinearKernelConfig,
    select_linear_kernel,
)
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

CPU = PlatformInfo(name="cpu", device_type="cpu")
CUDA = PlatformInfo(name="cuda", device_type="cuda", device_capability=(8, 0))
BF16 = LinearKernelConfig(
    scheme="unquantized", weight_dtype="float32", act_dtype="float32", input_size=8,
    output_size=4,
)
INT8 = LinearKernelConfig(
    scheme="int8_w8a8", weight_dtype="int8", act_dtype="float32", input_size=8, output_size=4
)


class TorchRef(LinearKernel):
    name = "torch_ref"
    priority = 0

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if config.scheme != "unquantized":
            return Support.no(f"scheme {config.scheme} is not unquantized")
        return Support.yes()

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        return torch.nn.functional.linear(x, weight, bias)


class CudaFast(TorchRef):
    name = "cuda_fast"
    priority = 100

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        if platform.device_type != "cuda":
            return Support.no(f"needs a CUDA device, found {platform.device_type}")
        return Support.yes()


class MidB(TorchRef):
    name = "mid_b"
    priority = 50


class MidA(TorchRef):
    name = "mid_a"
    priority = 50


ALL: list[type[LinearKernel]] = [TorchRef, MidB, CudaFast, MidA]


def test_highest_priority_supported_kernel_wins() -> None:
    assert select_linear_kernel(ALL, CUDA, BF16) is CudaFast


def test_ties_are_broken_by_name_whatever_the_input_order() -> None:
    assert select_linear_kernel(ALL, CPU, BF16) is MidA
    assert select_linear_kernel(list(reversed(ALL)), CPU, BF16) is MidA


def test_disabled_kernels_are_skipped() -> None:
    assert select_linear_kernel(ALL, CPU, BF16, disabled={"mid_a"}) is MidB
    assert select_linear_kernel(ALL, CPU, BF16, disabled=["mid_a", "mid_b"]) is TorchRef


def test_forced_kernel_is_the_only_one_considered() -> None:
    assert select_linear_kernel(ALL, CUDA, BF16, forced="torch_ref") is TorchRef


def test_forced_kernel_that_cannot_run_says_why() -> None:
    with pytest.raises(UnsupportedError) as info:
        select_linear_kernel(ALL, CPU, BF16, forced="cuda_fast")
    assert info.value.reasons == (("cuda_fast", "needs a CUDA device, found cpu"),)
    assert "--linear-kernel" in str(info.value)


def test_unknown_forced_kernel_lists_known_ones() -> None:
    with pytest.raises(ValidationError) as info:
        select_linear_kernel(ALL, CPU, BF16, forced="nope")
    assert "known: cuda_fast, mid_a, mid_b, torch_ref" in str(info.value)
    assert info.value.param == "linear_kernel"


def test_unknown_disabled_kernel_lists_known_ones() -> None:
    with pytest.raises(ValidationError, match="unknown linear kernel\\(s\\) typo; known: cuda_f"):
        select_linear_kernel(ALL, CPU, BF16, disabled=["typo", "mid_a"])


def test_forced_and_disabled_together_is_an_error() -> None:
    with pytest.raises(ValidationError, match="also listed in --disabled-kernels"):
        select_linear_kernel(ALL, CPU, BF16, forced="mid_a", disabled=["mid_a"])


def test_all_rejected_lists_each_kernel_with_its_reason_in_priority_order() -> None:
    with pytest.raises(UnsupportedError) as info:
        select_linear_kernel(ALL, CPU, INT8, disabled=["mid_b"])
    assert info.value.reasons == (
        ("cuda_fast", "needs a CUDA device, found cpu"),
        ("mid_a", "scheme int8_w8a8 is not unquantized"),
        ("mid_b", DISABLED_REASON),
        ("torch_ref", "scheme int8_w8a8 is not unquantized"),
    )
    message = str(info.value)
    assert message.startswith("no linear kernel can run scheme=int8_w8a8")
    assert "on cpu" in message.splitlines()[0]
    assert "  - mid_b: disabled by --disabled-kernels" in message


def test_no_candidates_at_all() -> None:
    with pytest.raises(UnsupportedError, match="no linear kernel can run"):
        select_linear_kernel([], CPU, BF16)
    with pytest.raises(ValidationError, match="known: \\(none installed\\)"):
        select_linear_kernel([], CPU, BF16, forced="x")


def test_duplicate_names_are_an_error_naming_both() -> None:
    class Clash(TorchRef):
        name = "torch_ref"

    with pytest.raises(ValueError, match="two linear kernels are named 'torch_ref'.*Clash"):
        select_linear_kernel([TorchRef, Clash], CPU, BF16)


def test_abstract_kernel_is_rejected_with_a_reason() -> None:
    class Unfinished(LinearKernel):
        name = "unfinished"
        priority = 1000

        @classmethod
        def is_supported(cls, platform: PlatformInfo) -> Support:
            return Support.yes()

    assert select_linear_kernel([Unfinished, TorchRef], CPU, BF16) is TorchRef  # type: ignore[type-abstract]
    with pytest.raises(UnsupportedError) as info:
        select_linear_kernel([Unfinished], CPU, BF16)  # type: ignore[type-abstract]
    reason = dict(info.value.reasons)["unfinished"]
    assert "abstract" in reason and "apply" in reason and "can_implement" in reason
    with pytest.raises(TypeError, match="abstract"):
        Unfinished(BF16)  # type: ignore[abstract]


def test_non_support_answer_is_a_type_error() -> None:
    class Sloppy(TorchRef):
        name = "sloppy"

        @classmethod
        def can_implement(cls, config: LinearKernelConfig) -> Support:
            return (True, "")  # type: ignore[return-value]

    with pytest.raises(TypeError, match="sloppy: can_implement\\(\\) must return"):
        select_linear_kernel([Sloppy], CPU, BF16)


def test_selected_kernel_computes_the_matmul() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    kernel = select_linear_kernel(ALL, CPU, BF16)(BF16)
    assert kernel.config is BF16
    kernel.process_weights_after_loading(layer)  # default: nothing
    x = torch.randn(3, 8)
    torch.testing.assert_close(kernel.apply(layer, x, layer.bias), layer(x))


def test_config_is_frozen_and_describes_itself() -> None:
    config = LinearKernelConfig(scheme="w4a16", weight_dtype="uint4", act_dtype="bfloat16",
                                input_size=4096, output_size=1024, group_size=128,
                                zero_point=True)
    assert config.describe() == (
        "scheme=w4a16 weight=uint4 act=bfloat16 [4096 -> 1024] group_size=128 zero_point"
    )
    assert hash(config) == hash(LinearKernelConfig(**config.__dict__))
    assert "channelwise" in BF16.describe()


def test_sdk_version_and_default_priority() -> None:
    assert CudaFast.sdk_version == __version__
    assert LinearKernel.priority == 0
