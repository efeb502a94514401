"""The CPU step graph records plugins that declare it (``engine.sdk.capture``), and only them.

Every component of the pass answers ``capture_support``: engine-test-plugin-capture's
Qwen3 (built through ``ctx.layers``) and its kernel composing the engine's ``cpu`` kernel
are recorded, and so are its kernel calling its own C code through the SDK's
``GraphFunction`` (``engine.sdk.graph_calls``) and its attention backend whose own
metadata builder gives the graph fixed buffers (``graph_metadata``); a subclass of a
built-in inherits its declaration; a model or custom op that does not declare keeps the
pass eager, named with its plugin in the INFO line; a kernel that declares but
multiplies in torch is refused by the recorder, naming the op.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.model_executor.models.llama import LlamaForCausalLM
from engine.core.native.graph import KernelGraph
from engine.kernels.cpu.attention import CpuAttentionBackend, CpuAttentionMetadataBuilder
from engine.kernels.cpu.native import native_kernels
from engine.sdk.capture import CaptureContext
from engine.sdk.groups import ATTENTION_BACKENDS, CUSTOM_OPS, MODELS
from engine.sdk.model import ModelInterface
from engine.sdk.ops import RMSNormOp
from engine.testing.engine import assert_kv_pool_full, hf_greedy
from engine.testing.test_plugins import entry_installer, install_test_plugins, put_on_path

NATIVE = native_kernels()
pytestmark = pytest.mark.skipif(
    NATIVE is None or torch.float32 not in NATIVE.packed_matmul_dtypes,
    reason="the packed float32 product is built for AVX-512 CPUs only (oneDNN multiplies "
           "4+ rows elsewhere, which a graph cannot call)")

PROMPTS = [[5 + i for i in range(n)] for n in (3, 40, 17, 1)]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LOGGER = "engine.core.worker.step_graph"
PLUGIN = "distribution engine-test-plugin-capture 0.1.0"


class SubLlama(LlamaForCausalLM):
    """A plugin's subclass of the built-in model: it inherits its declaration."""


class UndeclaredLlama(LlamaForCausalLM):
    """A plugin model that keeps the SDK's default answer (no)."""

    capture_support = ModelInterface.capture_support


class ScaledLogitsLlama(LlamaForCausalLM):
    """``compute_logits`` computes in torch: recorded without it, which stays eager."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) * 0.5


class TorchRMSNorm(RMSNormOp):
    """A custom op with a CPU path of its own that declares nothing."""

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.forward_native(x, residual)


class RaisingBuilder(CpuAttentionMetadataBuilder):
    """A metadata builder whose ``graph_metadata`` fails."""

    def graph_metadata(self, ctx: CaptureContext) -> Any:
        raise RuntimeError("no buffers today")


class RaisingBackend(CpuAttentionBackend):
    @classmethod
    def get_builder_cls(cls) -> Any:
        return RaisingBuilder


@pytest.fixture(scope="module")
def capture_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """engine-test-plugin-capture, pip-installed into a directory of its own."""
    return install_test_plugins(tmp_path_factory.mktemp("capture-site"), ("capture",))


@pytest.fixture
def capture_plugins(capture_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield put_on_path(capture_site, monkeypatch)


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 64, "in_process": True,
                               "max_num_batched_tokens": 64}
    return LLM(str(path), **{**options, **kwargs})


def runner_of(llm: LLM) -> Any:
    return llm.llm_engine.core.worker.model_runner


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_kv_pool_full(llm)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the step graphs' runs."""
    calls: Counter[str] = Counter()
    original = KernelGraph.run

    def run(self: KernelGraph, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls["run"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KernelGraph, "run", run)
    return calls


def test_a_qwen3_model_plugin_is_recorded_and_gives_the_tokens_of_transformers(
        capture_plugins: Path, tiny_qwen3: Path, replays: Counter[str],
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER), make_llm(tiny_qwen3) as llm:
        runner = runner_of(llm)
        assert type(runner.model).__module__ == "engine_test_plugin_capture.qwen3"
        graph = runner.step_graph
        assert graph is not None and graph.graph.num_stages == 2  # compute_logits too
        assert "CPU step graph: the forward pass runs as" in caplog.text
        replays.clear()
        tokens = generate(llm)
    assert replays["run"] >= MAX_TOKENS - 1  # the decode steps replayed the graph
    assert tokens == hf_greedy(tiny_qwen3, PROMPTS, MAX_TOKENS)
    assert len({tuple(t) for t in tokens}) == len(tokens)  # not a degenerate model


def test_a_plugin_kernel_composing_the_cpu_kernel_is_recorded(
        capture_plugins: Path, tiny_llama: Path, replays: Counter[str]) -> None:
    from engine_test_plugin_capture.kernels import PREPARED  # type: ignore[import-not-found]

    with make_llm(tiny_llama, linear_kernel="test_capture_cpu", enforce_eager=True) as llm:
        eager = generate(llm)
    PREPARED.clear()
    with make_llm(tiny_llama, linear_kernel="test_capture_cpu") as llm:
        runner = runner_of(llm)
        kernel = runner.model.layers[0].mlp.down_proj.quant_method.kernel
        assert type(kernel).__name__ == "ComposedCpuKernel" and PREPARED["test_capture_cpu"]
        assert runner.step_graph is not None
        replays.clear()
        assert generate(llm) == eager
    assert replays["run"] >= MAX_TOKENS - 1


def test_a_plugin_kernel_with_its_own_native_code_is_recorded(
        capture_plugins: Path, tiny_llama: Path, replays: Counter[str]) -> None:
    from engine_test_plugin_capture import native  # type: ignore[import-not-found]

    with make_llm(tiny_llama, linear_kernel="test_capture_native", enforce_eager=True) as llm:
        eager = generate(llm)
    assert native.CALLS["apply"] > 0  # its C code multiplied every layer, eagerly
    with make_llm(tiny_llama, linear_kernel="test_capture_native") as llm:
        graph = runner_of(llm).step_graph
        assert graph is not None
        # Its calls are in the graph beside the engine's own kernels' (7 products a layer).
        names = Counter(graph.graph.names)
        assert names["test_capture.matmul"] >= 7 and names["paged_attention"] >= 1
        replays.clear()
        calls = native.CALLS["apply"]
        assert generate(llm) == eager
        assert native.CALLS["apply"] - calls < MAX_TOKENS  # the decode steps ran the graph
    assert replays["run"] >= MAX_TOKENS - 1
    assert eager == hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


def test_a_plugin_attention_backend_with_its_own_metadata_builder_is_recorded(
        capture_plugins: Path, tiny_llama: Path, replays: Counter[str]) -> None:
    from engine_test_plugin_capture import attention  # type: ignore[import-not-found]

    with make_llm(tiny_llama, enforce_eager=True) as llm:
        eager = generate(llm)
    with make_llm(tiny_llama, attention_backend="test_capture_paged") as llm:
        runner = runner_of(llm)
        assert type(runner.builder).__module__ == "engine_test_plugin_capture.attention"
        assert runner.step_graph is not None
        replays.clear()
        fills = attention.FILLS["fill"]
        assert generate(llm) == eager
    assert replays["run"] >= MAX_TOKENS - 1
    assert attention.FILLS["fill"] - fills == replays["run"]  # its buffers, every replay


def test_a_kernel_that_declares_but_multiplies_in_torch_is_refused_naming_the_op(
        capture_plugins: Path, tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER), make_llm(
            tiny_llama, linear_kernel="test_capture_torch") as llm:
        assert runner_of(llm).step_graph is None
        generate(llm)
    line = next(r.message for r in caplog.records if "CPU step graph" in r.message)
    assert "the model runs eagerly (the forward pass runs the torch op aten." in line
    assert (f"in layers.0.self_attn.qkv_proj (quantization method "
            f"engine.core.model_executor.layers.linear.UnquantizedLinearMethod, linear kernel "
            f"'test_capture_torch' (engine_test_plugin_capture.kernels.DeclaredTorchKernel) of "
            f"plugin 'test_capture_torch' (group engine.linear_kernels, {PLUGIN}))") in line


def test_a_subclass_of_a_built_in_model_inherits_its_declaration(
        monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    with make_llm(tiny_llama, plugins="none", enforce_eager=True) as llm:
        eager = generate(llm)
    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(MODELS, "LlamaForCausalLM", SubLlama)
    with make_llm(tiny_llama) as llm:
        assert type(runner_of(llm).model) is SubLlama
        assert runner_of(llm).step_graph is not None
        assert generate(llm) == eager


@pytest.mark.parametrize(("group", "name", "cls", "reason"), [
    (MODELS, "LlamaForCausalLM", UndeclaredLlama,
     f"(model {__name__}.UndeclaredLlama of plugin 'LlamaForCausalLM' (group engine.models, "
     f"distribution acme-plugins 0.1.0): the model UndeclaredLlama does not declare that the "
     f"CPU step graph can record it"),
    (CUSTOM_OPS, "rms_norm", TorchRMSNorm,
     f"(layers.0.input_layernorm (custom op 'rms_norm' ({__name__}.TorchRMSNorm) of plugin "
     f"'rms_norm' (group engine.custom_ops, distribution acme-plugins 0.1.0)): custom op "
     f"'rms_norm' (TorchRMSNorm) does not declare that the CPU step graph can record it"),
])
def test_a_component_that_does_not_declare_keeps_the_pass_eager_naming_its_plugin(
        monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, caplog: pytest.LogCaptureFixture,
        group: str, name: str, cls: type, reason: str) -> None:
    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(group, name, cls)
    with caplog.at_level(logging.INFO, logger=LOGGER), make_llm(tiny_llama) as llm:
        assert runner_of(llm).step_graph is None
        generate(llm)
    lines = [r.message for r in caplog.records if "CPU step graph" in r.message]
    assert len(lines) == 1 and f"not used, the model runs eagerly {reason}" in lines[0]


def test_a_metadata_builder_whose_graph_metadata_raises_keeps_the_pass_eager_named(
        monkeypatch: pytest.MonkeyPatch, tiny_llama: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    with make_llm(tiny_llama, plugins="none", enforce_eager=True) as llm:
        eager = generate(llm)
    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(ATTENTION_BACKENDS, "cpu",
                                                          RaisingBackend)
    with caplog.at_level(logging.INFO, logger=LOGGER), make_llm(tiny_llama) as llm:
        assert type(runner_of(llm).builder) is RaisingBuilder
        assert runner_of(llm).step_graph is None
        assert generate(llm) == eager  # served, eagerly
    lines = [r.message for r in caplog.records if "CPU step graph" in r.message]
    assert len(lines) == 1, lines
    assert (f"not used, the model runs eagerly ((attention metadata builder {__name__}."
            f"RaisingBuilder of plugin 'cpu' (group engine.attention_backends, distribution "
            f"acme-plugins 0.1.0)): graph_metadata raised RuntimeError: no buffers today)"
            ) in lines[0]


def test_a_compute_logits_the_graph_cannot_record_stays_eager_alone(
        monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, caplog: pytest.LogCaptureFixture,
        replays: Counter[str]) -> None:
    entry_installer(monkeypatch, "acme-plugins", "0.1.0")(MODELS, "LlamaForCausalLM",
                                                          ScaledLogitsLlama)
    with make_llm(tiny_llama, enforce_eager=True) as llm:
        eager = generate(llm)
    with caplog.at_level(logging.INFO, logger=LOGGER), make_llm(tiny_llama) as llm:
        graph = runner_of(llm).step_graph
        assert graph is not None and graph.graph.num_stages == 1
        replays.clear()
        assert generate(llm) == eager
    assert replays["run"] >= MAX_TOKENS - 1
    assert "the LM head eager (the forward pass runs the torch op aten.mul" in caplog.text


def test_a_hook_that_raises_or_answers_wrongly_is_a_no() -> None:
    from engine.core.worker.capture_components import PassComponents
    from engine.sdk.capture import CaptureContext, GraphKind

    class Raising(torch.nn.Module):
        def capture_support(self, ctx: Any) -> Any:
            raise KeyError("oops")

    class Wrong(torch.nn.Module):
        def capture_support(self, ctx: Any) -> Any:
            return True

    ctx = CaptureContext(kind=GraphKind.CPU_STEP_GRAPH)
    for model, why in ((Raising(), "its capture_support raised KeyError: 'oops'"),
                       (Wrong(), "its capture_support returned True, not an engine.sdk.Support"),
                       (torch.nn.Identity(), "it does not declare capture support")):
        reason = PassComponents(model, ctx).model_refusal()
        assert reason is not None and why in reason, reason


def test_components_held_by_components_are_asked() -> None:
    """A kernel held in a list by a quantization method, one held by that kernel."""
    from engine.core.model_executor.linear_kernels import TorchLinearKernel as Kernel
    from engine.core.worker.capture_components import held_components, held_tensors
    from engine.sdk.linear_kernel import LinearKernelConfig
    from engine.sdk.quantization import QuantizeMethod

    class Method(QuantizeMethod):
        def create_weights(self, layer: Any, info: Any) -> None: ...

        def apply(self, layer: Any, x: Any, bias: Any = None) -> Any: ...

    config = LinearKernelConfig("unquantized", "float32", "float32", 4, 4)
    inner, outer = Kernel(config), Kernel(config)
    outer.inner = inner  # type: ignore[attr-defined]
    inner.panels = torch.ones(3)  # type: ignore[attr-defined]
    method = Method()
    method.kernels = [outer]  # type: ignore[attr-defined]
    layer = torch.nn.Linear(4, 4)
    layer.quant_method = method  # type: ignore[assignment]
    assert held_components(layer) == [method, outer, inner]
    assert [t.shape for t in held_tensors(layer)] == [(3,)]
