"""CPU step graphs: the forward pass recorded once, replayed in C, the same tokens as eager.

End to end (tiny Llama, float32, EngineCore in process so the block pool can be checked):
the graph serves steps up to its size and the model runs eagerly above it, with the tokens
and logprobs of ``--enforce-eager``; what cannot be a graph (``--enforce-eager``, another
attention backend or linear kernel, a module hook) leaves the model eager with the reason
logged. Unit level: ``engine.core.native.graph`` refuses torch compute and calls that depend
on the token count, and its arena never overlaps buffers alive at once.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.model_executor.models.llama import LlamaForCausalLM
from engine.core.native import graph as native_graph
from engine.core.native.graph import KernelGraph, NotCapturable, record
from engine.core.native.runtime import graph_runtime
from engine.core.worker import step_graph
from engine.kernels.cpu.native import library, native_kernels
from engine.sdk import graph_calls
from engine.sdk.graph_calls import GraphFunction

NATIVE = native_kernels()
RUNTIME = graph_runtime()
pytestmark = pytest.mark.skipif(
    NATIVE is None or torch.float32 not in NATIVE.packed_matmul_dtypes,
    reason="the packed float32 product is built for AVX-512 CPUs only (oneDNN multiplies "
           "4+ rows elsewhere, which a graph cannot call)")

PROMPTS = [[5 + i for i in range(n)] for n in (3, 40, 17, 90, 1)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                        prompt_logprobs=1)


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "plugins": "none", "num_kv_blocks": 64,
                               "in_process": True, "max_num_batched_tokens": 64}
    return LLM(str(path), **{**options, **kwargs})


def runner_of(llm: LLM) -> Any:
    return llm.llm_engine.core.worker.model_runner


def generate(llm: LLM) -> list[Any]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    stats = llm.llm_engine.core.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


@pytest.fixture(scope="module")
def eager(tiny_llama: Path) -> list[Any]:
    with make_llm(tiny_llama, enforce_eager=True) as llm:
        assert runner_of(llm).step_graph is None
        return generate(llm)


def test_the_graph_serves_small_steps_with_the_eager_tokens(
        tiny_llama: Path, eager: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()
    for cls, name in ((KernelGraph, "run"), (LlamaForCausalLM, "forward")):
        original = getattr(cls, name)

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = name,
                    **kwargs: Any) -> Any:
            calls[_name] += 1
            calls[f"{_name} stages={kwargs.get('stages', 1)}"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    monkeypatch.setattr(step_graph, "MAX_GRAPH_TOKENS", 32)  # steps of 33-64 tokens: eager
    with make_llm(tiny_llama) as llm:
        graph = runner_of(llm).step_graph
        assert graph is not None and graph.rows == 32
        calls.clear()
        got = generate(llm)
    assert got == eager  # tokens, logprobs and prompt logprobs, exactly
    assert calls["run"] >= 11 and calls["forward"] >= 1  # decodes in the graph, big steps not
    # decode steps take their logits from the graph's LM head stage; others from the model
    assert calls["run stages=2"] >= 10 and calls["run stages=1"] >= 1


@pytest.fixture(scope="module")
def bfloat16_values_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with every weight rounded to a bfloat16 value (stored as float32): what
    a bfloat16 checkpoint is when run in float32."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("bf16-values")
    for item in tiny_llama.iterdir():
        if item.name != "model.safetensors":
            (path / item.name).write_bytes(item.read_bytes())
    weights = load_file(tiny_llama / "model.safetensors")
    save_file({name: t.bfloat16().float() for name, t in weights.items()},
              path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_weights_packed_as_bfloat16_give_the_float32_panels_tokens(
        bfloat16_values_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the build packs a float32 weight of bfloat16 values as bfloat16 (AVX2), the
    graph gives exactly the eager pass's tokens and logprobs, and the tokens of float32
    panels (those sum 1-3 rows on the dense weight, in another order: logprobs may differ
    in float32's last bits)."""
    assert NATIVE is not None
    widens = NATIVE.packs_float32_as_bfloat16

    def panels_dtype(llm: LLM) -> torch.dtype:
        return runner_of(llm).model.layers[0].mlp.down_proj.quant_method.kernel.panels.dtype

    got = {}
    for name, options in (("graph", {}), ("eager", {"enforce_eager": True})):
        with make_llm(bfloat16_values_llama, **options) as llm:
            assert panels_dtype(llm) == (torch.bfloat16 if widens else torch.float32)
            assert (runner_of(llm).step_graph is None) == (name == "eager")
            got[name] = generate(llm)
    monkeypatch.setattr(NATIVE, "packs_float32_as_bfloat16", False)
    with make_llm(bfloat16_values_llama) as llm:
        assert panels_dtype(llm) == torch.float32
        plain = generate(llm)
    assert got["graph"] == got["eager"]
    assert [tokens for tokens, _, _ in got["graph"]] == [tokens for tokens, _, _ in plain]


@pytest.mark.parametrize(("options", "reason"), [
    ({"enforce_eager": True}, "(--enforce-eager)"),
    ({"attention_backend": "torch"}, "(attention metadata builder engine.core.attention."
     "torch_backend.TorchAttentionMetadataBuilder): it gives no metadata a graph can hold "
     "(its graph_metadata returns None)"),
    ({"linear_kernel": "onednn"}, "layers.0.self_attn.qkv_proj (linear kernel 'onednn' "
     "(engine.kernels.cpu.linear.OneDNNLinearKernel) of plugin 'onednn' (group "
     "engine.linear_kernels, distribution engine-kernels 0.1.0)): oneDNN's product is not a "
     "native kernel"),
])
def test_what_cannot_be_a_graph_runs_eagerly_and_says_why(
        tiny_llama: Path, eager: list[Any], caplog: pytest.LogCaptureFixture,
        options: dict[str, Any], reason: str) -> None:
    with caplog.at_level(logging.INFO, logger="engine.core.worker.step_graph"):
        llm = make_llm(tiny_llama, **options)
    with llm:
        assert runner_of(llm).step_graph is None
        assert "CPU step graph: not used, the model runs eagerly" in caplog.text
        assert reason in caplog.text
        got = generate(llm)
    if "enforce_eager" in options:  # other kernels sum in other orders
        assert got == eager


def test_layers_holding_another_load_of_the_kernels_are_recorded(
        tiny_llama: Path, eager: list[Any]) -> None:
    """A fresh ``load()`` (after its cache is cleared) gives the attention backend a new
    ``NativeKernels`` while ``native_kernels()`` keeps the first: both record."""
    library.load.cache_clear()
    try:
        with make_llm(tiny_llama) as llm:
            assert runner_of(llm).step_graph is not None
            got = generate(llm)
    finally:
        library.load.cache_clear()
    assert got == eager


def test_a_module_hook_drops_the_graph_when_recorded_again(tiny_llama: Path) -> None:
    """What ``collective_rpc`` does after an extension's method: the hook is called."""
    seen: list[int] = []
    with make_llm(tiny_llama) as llm:
        worker = llm.llm_engine.core.worker
        first = runner_of(llm).step_graph
        assert first is not None
        worker.capture_step_graph(again=True)  # nothing changed: recorded anew
        assert runner_of(llm).step_graph not in (None, first)
        worker.model.norm.register_forward_hook(lambda m, a, out: seen.append(1))
        worker.capture_step_graph(again=True)
        assert runner_of(llm).step_graph is None
        generate(llm)
    assert len(seen) > 12  # every step ran the model, hook included


# -- the recorder ---------------------------------------------------------------------------

def _known(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(tensors)


def test_a_graph_function_reading_memory_a_replay_cannot_reach_is_refused_naming_it(
) -> None:
    assert NATIVE is not None
    weight, elsewhere = torch.ones(8), torch.ones(8)
    function = NATIVE.graph_functions["silu_and_mul"]  # recorded, never run
    plugin = GraphFunction(function.address, "acme.copy")

    def forward(rows: int) -> torch.Tensor:
        x = torch.empty(rows, 8)
        plugin(elsewhere, 0, x, 32, rows, 32)
        return x

    with pytest.raises(NotCapturable, match=r"^acme\.copy reads memory that is neither the "
                                            r"model's"):
        record(RUNTIME, forward, 4, _known(weight))
    recording = record(RUNTIME, forward, 4, _known(weight, elsewhere))
    assert [(call.name, call.address) for call in recording.ops] == [
        ("acme.copy", function.address)]


def test_torch_compute_in_the_pass_is_refused_naming_the_op() -> None:
    assert NATIVE is not None
    weight = torch.ones(8)

    def forward(rows: int) -> torch.Tensor:
        x = torch.empty(rows, 8)
        NATIVE.rms_norm(x, None, weight, 1e-6)
        return x + 1

    with pytest.raises(NotCapturable, match=r"runs the torch op aten\.add"):
        record(RUNTIME, forward, 4, _known(weight))
    assert not graph_calls.is_recording()  # left as it was


def test_a_call_that_depends_on_the_token_count_is_refused() -> None:
    assert NATIVE is not None
    weight = torch.ones(8)

    def last_row(rows: int) -> torch.Tensor:
        x = torch.empty(rows, 8)
        NATIVE.rms_norm(x[rows - 1:], None, weight, 1e-6)  # a pointer that moves with rows
        return x

    recordings = [record(RUNTIME, last_row, n, _known(weight)) for n in (8, 2)]
    with pytest.raises(NotCapturable, match="argument 1 of rms_norm .* depends on the token"):
        KernelGraph.from_recordings(RUNTIME, recordings)


def test_memory_the_graph_does_not_own_is_refused() -> None:
    assert NATIVE is not None
    weight = torch.ones(8)

    def forward(rows: int) -> torch.Tensor:
        x = torch.empty(rows, 8)
        NATIVE.rms_norm(x, None, weight, 1e-6)
        return x

    with pytest.raises(NotCapturable, match="reads memory that is neither"):
        record(RUNTIME, forward, 4, _known())


def test_replay_computes_what_the_kernels_compute_for_any_row_count() -> None:
    """A chain of norms through buffers of different lifetimes, against eager calls."""
    assert NATIVE is not None
    source = torch.randn(16, 8)
    w1, w2 = torch.rand(8) + 0.5, torch.rand(8) + 0.5

    def forward(rows: int) -> torch.Tensor:
        a = source[:rows].clone()  # recorded as copy_rows
        NATIVE.rms_norm(a, None, w1, 1e-6)
        b = torch.empty(rows, 8)
        RUNTIME.copy_rows(a, b)
        c = torch.empty(rows, 8)  # a is dead from here: c may take its place
        RUNTIME.copy_rows(b, c)
        NATIVE.rms_norm(c, b, w2, 1e-6)
        return c

    graph = KernelGraph.from_recordings(
        RUNTIME, [record(RUNTIME, forward, n, _known(source, w1, w2)) for n in (16, 2, 3)])
    assert graph.num_ops == 5 and graph.arena_bytes < 3 * 16 * 8 * 4
    for rows in (1, 5, 16):
        assert torch.equal(graph.run(rows), forward(rows))
    with pytest.raises(ValueError, match="recorded for up to 16 tokens cannot run 17"):
        graph.run(17)


def test_an_argument_that_is_a_multiple_of_the_token_count_replays_for_any_count() -> None:
    """Per-head norms: ``[rows, heads * d]`` normalised as ``[rows * heads, d]`` rows."""
    assert NATIVE is not None
    heads, d = 3, 8
    source = torch.randn(16, heads * d)
    weight = torch.rand(d) + 0.5

    def forward(rows: int) -> torch.Tensor:
        x = source[:rows].clone()
        NATIVE.rms_norm(x.view(rows * heads, d), None, weight, 1e-6)
        return x

    graph = KernelGraph.from_recordings(
        RUNTIME, [record(RUNTIME, forward, n, _known(source, weight)) for n in (16, 2, 3)])
    for rows in (1, 5, 16):
        assert torch.equal(graph.run(rows), forward(rows))


def test_a_stage_may_end_in_a_float32_conversion_which_the_caller_makes() -> None:
    """``compute_logits``' ``.float()``: the stage's output is the rows before it."""
    assert NATIVE is not None
    source = torch.randn(8, 4).bfloat16()

    def forward(rows: int) -> torch.Tensor:
        return source[:rows].clone()

    graph = KernelGraph.from_recordings(RUNTIME, [
        record(RUNTIME, forward, n, _known(source), then=lambda h: h.float()) for n in (8, 2)])
    out = graph.run(5, stages=2)
    assert out.dtype == torch.bfloat16 and torch.equal(out, source[:5])
    with pytest.raises(NotCapturable, match=r"converts \(8, 4\) torch.bfloat16 to "
                                            r"torch.float16"):
        record(RUNTIME, forward, 8, _known(source), then=lambda h: h.half())


def test_buffers_alive_at_once_never_share_the_arena() -> None:
    recording = native_graph._Recording(4)
    for size in (256, 64, 512, 128):
        recording.allocated(torch.empty(size, dtype=torch.uint8))
    buffers = [native_graph._Buffer(i, 0) for i in range(4)]
    # lifetimes (by call): 0: [0, 1], 1: [1, 2], 2: [2, 3], 3: [0, 3] (the output)
    recording.ops = [native_graph._Call("copy_rows", 1, [a, b])
                     for a, b in ((buffers[0], buffers[3]), (buffers[0], buffers[1]),
                                  (buffers[1], buffers[2]), (buffers[2], buffers[3]))]
    recording.outputs = [(buffers[3], (1,), (1, 1), torch.uint8)]
    offsets, total = native_graph._plan(recording)
    spans = native_graph._lifetimes(recording)
    sizes = recording.sizes()
    for i in range(4):
        for j in range(i):
            (fi, li), (fj, lj) = spans[i], spans[j]  # type: ignore[misc]
            if fi <= lj and fj <= li:
                assert (offsets[i] + sizes[i] <= offsets[j]
                        or offsets[j] + sizes[j] <= offsets[i]), (i, j, offsets)
    assert total < sum(sizes)  # buffer 0 and buffer 2 share a place
