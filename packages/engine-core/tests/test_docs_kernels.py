"""docs/plugins/{attention-backends,linear-kernels,quantization}.md: the examples serve.

Each page's complete class is written to the module its "Registering" section names
(``my_plugin.attention``, ``my_plugin.kernels``, ``my_plugin.quant``) and run in a real
engine on the tiny test checkpoint, in this process:

* the ``torch_paged`` backend, selected by ``--attention-backend``, gives the greedy
  tokens of the built-in backend, and refuses what its ``supports`` says it refuses;
* the ``my_int8`` method (selected by the checkpoint's ``quant_method``, with its
  ``modules_to_not_convert``) on a checkpoint quantized to channelwise int8, computing
  through the page's ``torch_int8`` kernel, gives the greedy tokens of the float
  checkpoint holding the same (dequantized) weights; quantization.md's own test block
  (``# tests/test_my_int8.py``, whose ``quantize`` builds those checkpoints here too)
  passes as written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.core import LLM
from engine.sdk import SamplingParams, Support, UnsupportedError
from engine.sdk.attention import AttentionSpec, backend_supports, select_backend
from engine.sdk.groups import LINEAR_KERNELS, QUANTIZATION
from engine.sdk.linear_kernel import LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.testing.docs import code_block, exec_block, page_package
from engine.testing.engine import assert_kv_pool_full
from engine.testing.test_plugins import entry_installer

#: Each page's python block (by its first line) and the ``my_plugin`` module it becomes.
MODULES = {
    "attention-backends.md": ("from __future__ import annotations", "attention"),
    "linear-kernels.md": ("from __future__ import annotations", "kernels"),
    "quantization.md": ("from __future__ import annotations", "quant"),
}
#: linear-kernels.md's kernel composing the engine's ``cpu`` kernel (my_plugin.composed).
COMPOSED = "# src/my_plugin/composed.py"
#: attention-backends.md's backend answering a spec field added in 1.1 (my_plugin.capped).
CAPPED = "# src/my_plugin/capped.py"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(3, 30)), [7, 7, 8, 9], list(range(200, 205)) * 3]
#: Checkpoint modules the quantized checkpoint keeps in float (its modules_to_not_convert).
SKIP = "mlp.down_proj"


@pytest.fixture(scope="module")
def my_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    modules = {module: code_block(page, first_line)
               for page, (first_line, module) in MODULES.items()}
    modules["composed"] = code_block("linear-kernels.md", COMPOSED)
    modules["capped"] = code_block("attention-backends.md", CAPPED)
    with page_package(tmp_path_factory.mktemp("docs"), "my_plugin", modules) as root:
        yield root


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, type], None]:
    """``install(group, name, cls)``: the engine discovers ``cls`` as an installed entry."""
    return entry_installer(monkeypatch, "my-engine-plugins", "0.1")


def tiny(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "in_process": True, "num_kv_blocks": 32,
                             **kwargs})


def greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# -- attention-backends.md ------------------------------------------------------------------


def test_the_torch_paged_backend_serves_the_engine(my_plugin: Path, tiny_llama: Path) -> None:
    from my_plugin.attention import TorchImpl

    with tiny(tiny_llama, plugins="none") as llm:
        reference = greedy(llm)
    # Small blocks and a small budget: paged reads across blocks, chunked prefill, decode.
    with tiny(tiny_llama, plugins="none", block_size=4, num_kv_blocks=64, max_model_len=64,
              max_num_batched_tokens=16,
              attention_backend="my_plugin.attention:TorchPagedBackend") as llm:
        model = llm.llm_engine.core.worker.built.model
        assert all(isinstance(layer.self_attn.attn.impl, TorchImpl) for layer in model.layers)
        assert greedy(llm) == reference
        assert_kv_pool_full(llm)


def test_the_torch_paged_backend_turns_down_what_it_says(my_plugin: Path) -> None:
    from my_plugin.attention import TorchPagedBackend

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype="float32",
                         kv_cache_dtype="float32", block_size=16,
                         platform=PlatformInfo("cpu", "cpu"))
    assert TorchPagedBackend.supports(spec)
    windowed = replace(spec, sliding_window=4096)
    with pytest.raises(UnsupportedError) as refused:
        select_backend([TorchPagedBackend], windowed)
    assert "torch_paged: sliding window attention is not supported" in str(refused.value)
    assert not TorchPagedBackend.supports(replace(spec, kv_cache_dtype="bfloat16"))


def test_a_backend_answers_a_new_spec_field_only_where_it_lists_it(my_plugin: Path) -> None:
    from my_plugin.attention import TorchPagedBackend
    from my_plugin.capped import CappedBackend

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype="float32",
                         kv_cache_dtype="float32", block_size=16)
    capped = replace(spec, logits_soft_cap=50.0)
    # The page's first backend predates the field: the engine refuses it without asking.
    unlisted = backend_supports(TorchPagedBackend, capped)
    assert not unlisted and "answered_spec_fields" in unlisted.reason
    assert TorchPagedBackend.supports(capped)  # what it would have said, unseen
    # The one listing it is asked, and answers.
    assert backend_supports(CappedBackend, spec)
    assert backend_supports(CappedBackend, capped).reason == (
        "logits_soft_cap=50.0 not supported yet")


# -- linear-kernels.md + quantization.md ----------------------------------------------------


def page_test_namespace() -> dict[str, Any]:
    """quantization.md's test block, executed (its ``quantize`` is used here too)."""
    return exec_block(code_block("quantization.md", "# tests/test_my_int8.py"))


def quantize_checkpoint(source: Path, target: Path, reference: Path) -> None:
    """``target``: ``source`` with its linear layers in channelwise int8 (``my_int8``, the
    page's ``quantize``); ``reference``: the same weights dequantized to float32."""
    page_test_namespace()["quantize"](source, target, reference)


def test_the_quantization_page_test_passes(
        my_plugin: Path, install: Callable[[str, str, type], None], tiny_llama: Path,
        tmp_path: Path) -> None:
    from my_plugin.kernels import TorchInt8Kernel
    from my_plugin.quant import Int8Config

    install(QUANTIZATION, "my_int8", Int8Config)
    install(LINEAR_KERNELS, "torch_int8", TorchInt8Kernel)
    namespace = page_test_namespace()
    assert namespace["SKIP"] == SKIP
    ran = []
    for name in ("test_serves_the_checkpoint_like_its_dequantized_weights",
                 "test_bad_settings_stop_start_up"):
        namespace[name](tiny_llama_checkpoint=tiny_llama, tmp_path=tmp_path / name)
        ran.append(name)
    assert sorted(ran) == sorted(n for n in namespace if n.startswith("test_"))


def test_the_int8_method_and_kernel_serve_a_quantized_checkpoint(
        my_plugin: Path, install: Callable[[str, str, type], None], tiny_llama: Path,
        tmp_path: Path) -> None:
    from my_plugin.kernels import TorchInt8Kernel
    from my_plugin.quant import Int8Config, Int8LinearMethod

    install(QUANTIZATION, "my_int8", Int8Config)
    install(LINEAR_KERNELS, "torch_int8", TorchInt8Kernel)
    quantize_checkpoint(tiny_llama, tmp_path / "int8", tmp_path / "dequantized")
    with tiny(tmp_path / "dequantized") as llm:
        reference = greedy(llm)
    # The built-in int8_w8a8 kernels would win (priority 100; a tie at 0 goes by name).
    with tiny(tmp_path / "int8", disabled_kernels=("int8_int_mm", "int8_reference")) as llm:
        model = llm.llm_engine.core.worker.built.model
        layer = model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj.quant_method, Int8LinearMethod)
        assert isinstance(layer.self_attn.qkv_proj.quant_method.kernel, TorchInt8Kernel)
        assert layer.self_attn.qkv_proj.weight.dtype == torch.int8
        assert layer.mlp.down_proj.weight.dtype == torch.float32  # modules_to_not_convert
        assert model.lm_head.weight.dtype == torch.float32  # kind "lm_head": left alone
        assert greedy(llm) == reference
        assert_kv_pool_full(llm)


def test_the_int8_methods_float32_scales_keep_their_values_in_a_bfloat16_model(
        my_plugin: Path, install: Callable[[str, str, type], None], tiny_llama: Path,
        tmp_path: Path) -> None:
    """quantization.md, "Dtypes": a parameter is loaded in the dtype it was created with."""
    from my_plugin.kernels import TorchInt8Kernel
    from my_plugin.quant import Int8Config

    install(QUANTIZATION, "my_int8", Int8Config)
    install(LINEAR_KERNELS, "torch_int8", TorchInt8Kernel)
    quantize_checkpoint(tiny_llama, tmp_path / "int8", tmp_path / "dequantized")
    stored = load_file(tmp_path / "int8" / "model.safetensors")
    want = torch.cat([stored[f"model.layers.0.self_attn.{p}_proj.weight_scale"]
                      for p in "qkv"])
    assert not torch.equal(want.bfloat16().float(), want)  # bfloat16 would round them
    with tiny(tmp_path / "int8", dtype="bfloat16",
              disabled_kernels=("int8_int_mm", "int8_reference")) as llm:
        qkv = llm.llm_engine.core.worker.built.model.layers[0].self_attn.qkv_proj
        assert qkv.weight_scale.dtype == torch.float32
        assert torch.equal(qkv.weight_scale, want)
        assert len(greedy(llm)[0]) == GREEDY.max_tokens


def test_the_int8_kernel_claims_only_its_scheme(my_plugin: Path) -> None:
    from my_plugin.kernels import TorchInt8Kernel

    from engine.sdk.linear_kernel import LinearKernelConfig

    def config(**changes: Any) -> LinearKernelConfig:
        return LinearKernelConfig(**{"scheme": "int8_w8a8", "weight_dtype": "int8",
                                     "act_dtype": "float32", "input_size": 64,
                                     "output_size": 32, **changes})

    assert TorchInt8Kernel.can_implement(config())
    assert not TorchInt8Kernel.can_implement(config(group_size=128))
    assert not TorchInt8Kernel.can_implement(config(scheme="unquantized"))


def test_the_int8_methods_settings_are_checked(my_plugin: Path) -> None:
    from my_plugin.quant import Int8Config

    from engine.sdk import ValidationError

    assert Int8Config.from_config({"modules_to_not_convert": [SKIP]}).skip == (SKIP,)
    with pytest.raises(ValidationError, match="modules_to_not_convert must be a list"):
        Int8Config.from_config({"modules_to_not_convert": SKIP})
    assert not Int8Config.is_supported(PlatformInfo("npu", "npu"))


def test_the_kernel_composing_the_cpu_kernel_is_recorded_by_the_step_graph(
        my_plugin: Path, install: Callable[[str, str, type], None], tiny_llama: Path) -> None:
    """linear-kernels.md, "Graph capture": the step graph replays the composed kernel, and
    the page's torch_int8 says no to it (the model stays eager, naming the kernel)."""
    from my_plugin.composed import ClippedCpuKernel
    from my_plugin.kernels import TorchInt8Kernel

    from engine.kernels.cpu.native import native_kernels
    from engine.sdk.capture import CaptureContext, GraphKind

    kernels = native_kernels()
    if kernels is None or torch.float32 not in kernels.packed_matmul_dtypes:
        pytest.skip("the cpu kernel packs float32 weights on AVX-512 CPUs only")
    install(LINEAR_KERNELS, "clipped_cpu", ClippedCpuKernel)
    tokens = {}
    for eager in (True, False):
        with tiny(tiny_llama, linear_kernel="clipped_cpu", enforce_eager=eager) as llm:
            runner = llm.llm_engine.core.worker.model_runner
            kernel = runner.model.layers[0].mlp.down_proj.quant_method.kernel
            assert isinstance(kernel, ClippedCpuKernel)
            assert (runner.step_graph is None) == eager
            tokens[eager] = greedy(llm)
    assert tokens[True] == tokens[False]
    config = LinearKernelConfig("int8_w8a8", "int8", "float32", 8, 8)
    answer = TorchInt8Kernel(config).capture_support(
        CaptureContext(kind=GraphKind.CPU_STEP_GRAPH))
    assert answer == Support.no("F.linear is torch compute")
    assert TorchInt8Kernel(config).capture_support(CaptureContext(kind=GraphKind.CUDA_GRAPHS))
