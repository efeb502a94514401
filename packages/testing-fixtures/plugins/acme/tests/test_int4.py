"""acme_int4 + acme_int4_dequant: the format, the kernel's refusals, and an engine serving a
quantized checkpoint with the tokens of its dequantized twin."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from acme_engine_plugins.int4 import Int4Config
from acme_engine_plugins.int4_format import dequantize, pack, quantize, quantize_checkpoint, unpack
from acme_engine_plugins.int4_kernel import Int4DequantKernel

from engine.core import SamplingParams
from engine.sdk import ValidationError
from engine.sdk.linear_kernel import LinearKernelConfig
from engine.testing.engine import assert_kv_pool_full


def test_pack_round_trip_and_quantization_error() -> None:
    torch.manual_seed(0)
    q = torch.randint(-8, 8, (6, 64))
    assert torch.equal(unpack(pack(q)), q.to(torch.int8))
    weight = torch.randn(16, 64)
    qweight, scales = quantize(weight, 32)
    assert qweight.dtype == torch.uint8 and qweight.shape == (16, 32)
    assert scales.dtype == torch.float32 and scales.shape == (16, 2)
    error = (dequantize(qweight, scales) - weight).abs()
    step = scales.repeat_interleave(32, dim=1)  # one quantization step per group
    assert bool((error <= step / 2 + 1e-6).all())


def config(**changes: Any) -> LinearKernelConfig:
    values: dict[str, Any] = {"scheme": "acme_int4", "weight_dtype": "int4",
                              "act_dtype": "float32", "input_size": 64, "output_size": 16,
                              "group_size": 32, **changes}
    return LinearKernelConfig(**values)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"scheme": "int8_w8a8"}, "scheme int8_w8a8 is not acme_int4"),
    ({"group_size": None}, "an even group size only"),
    ({"input_size": 48}, "input size 48 is not whole groups of 32"),
    ({"zero_point": True}, "zero-point"),
])
def test_kernel_refuses_what_it_cannot_run(changes: dict[str, Any], reason: str) -> None:
    assert Int4DequantKernel.can_implement(config()).ok
    answer = Int4DequantKernel.can_implement(config(**changes))
    assert not answer.ok and reason in answer.reason


def test_settings_are_validated() -> None:
    assert Int4Config.from_config({}).group_size == 32
    with pytest.raises(ValidationError) as info:
        Int4Config.from_config({"group_size": 3})
    assert info.value.param == "group_size"


@pytest.fixture(scope="module")
def int4_checkpoints(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory,
                     ) -> tuple[Path, Path]:
    """The tiny Qwen3 quantized to acme_int4, and its dequantized (unquantized) twin."""
    root = tmp_path_factory.mktemp("int4")
    quantized = quantize_checkpoint(tiny_qwen3, root / "int4", group_size=32,
                                    dequantized=root / "dequantized")
    return quantized, root / "dequantized"


def test_a_quantized_checkpoint_gives_the_tokens_of_its_dequantized_twin(
    int4_checkpoints: tuple[Path, Path], make_llm: Callable[..., Any],
    spy: Callable[..., Any], prompts: list[list[int]],
) -> None:
    quantized, dequantized = int4_checkpoints
    calls = spy(Int4DequantKernel, "apply")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run(checkpoint: Path) -> list[Any]:
        with make_llm(checkpoint, worker_extensions=["acme_inspect"]) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            assert_kv_pool_full(llm)
            [memory] = llm.collective_rpc("acme_memory")
        return [outputs, memory["parameter_bytes"]]

    reference, reference_bytes = run(dequantized)
    assert calls["apply"] == 0  # an unquantized checkpoint never reaches the method
    got, got_bytes = run(quantized)  # selected by the checkpoint's quant_method
    assert calls["apply"] > 0
    assert got_bytes < reference_bytes  # the projections are stored in 4.5 bits per weight
    for ours, theirs in zip(got, reference, strict=True):
        assert list(ours.outputs[0].token_ids) == list(theirs.outputs[0].token_ids)
        assert [next(iter(s.values())).logprob for s in ours.outputs[0].logprobs] == (
            pytest.approx([next(iter(s.values())).logprob for s in theirs.outputs[0].logprobs],
                          abs=1e-4))


def test_without_a_kernel_start_up_stops_naming_each_kernels_reason(
    int4_checkpoints: tuple[Path, Path], make_llm: Callable[..., Any],
) -> None:
    from engine.sdk import UnsupportedError

    with pytest.raises(UnsupportedError, match="no linear kernel can run scheme=acme_int4") as info:
        make_llm(int4_checkpoints[0], disabled_kernels=["acme_int4_dequant"])
    assert "acme_int4_dequant: disabled by --disabled-kernels" in str(info.value)
