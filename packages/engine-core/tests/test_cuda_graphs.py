"""CUDA decode graphs: which steps replay, and what a replay reads (runs without a GPU).

A real capture needs CUDA (``packages/engine-kernels/tests/test_gpu.py`` checks it on a GPU
against ``--enforce-eager``). Here each graph is stood in for by the eager pass over the
graphs' static buffers, which is exactly what a captured graph replays: so decode steps
served through ``CudaGraphs`` (inputs copied in, padded to a captured size, a builder run
over the buffers) must give the eager engine's tokens (logprobs to rounding), the block
pool must be full afterwards, and prefill steps must not take a graph.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.worker.cuda_graphs import (
    CudaGraphs,
    DecodeBuffers,
    NotCapturable,
    capture_cuda_graphs,
    capture_sizes,
)
from engine.sdk.attention import CudaGraphSupport
from engine.sdk.model import ModelInterface

PROMPTS = [[5 + i for i in range(n)] for n in (3, 40, 17, 90, 1)]


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "plugins": "none", "num_kv_blocks": 64,
                               "in_process": True, "attention_backend": "torch",
                               "enforce_eager": True, "max_num_seqs": 8}
    return LLM(str(path), **{**options, **kwargs})


def generate(llm: LLM, max_tokens: list[int]) -> list[Any]:
    """One prompt alone, then every prompt at once; tokens and logprobs of each."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in max_tokens]
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params[0], use_tqdm=False)
    together = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
    stats = llm.llm_engine.core.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in [*alone, *together]]


class EagerReplay:
    """A captured graph's stand-in: the forward pass over the static buffers, into one
    output tensor, counted per size."""

    def __init__(self, model: Any, builder: Any, buffers: DecodeBuffers, size: int,
                 replays: Counter[int]) -> None:
        self.model, self.builder, self.buffers, self.size = model, builder, buffers, size
        self.replays = replays
        self.hidden = torch.zeros(size, model.config.hidden_size)

    def replay(self) -> None:
        buffers, size = self.buffers, self.size
        self.replays[size] += 1
        self.hidden.copy_(self.model(buffers.input_ids[:size], buffers.positions[:size],
                                     self.builder.build(buffers.common(size))))


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1000)[-3:] == [240, 248, 256]


def test_a_backend_without_graph_support_is_refused() -> None:
    with pytest.raises(NotCapturable, match="cudagraph_support is NEVER"):
        capture_cuda_graphs(torch.nn.Identity(), None,  # type: ignore[arg-type]
                            CudaGraphSupport.NEVER, sizes=[1], max_blocks=1,
                            max_model_len=16, block_size=16, device=torch.device("cpu"))


def test_a_model_that_does_not_declare_is_refused_naming_it() -> None:
    class Undeclared(torch.nn.Identity, ModelInterface):
        def forward(self, *args: Any) -> Any: ...

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

        def load_weights(self, weights: Any) -> set[str]: ...

    with pytest.raises(NotCapturable, match=r"the model .*Undeclared does not declare that "
                                            r"CUDA graphs can record it"):
        capture_cuda_graphs(Undeclared(), None,  # type: ignore[arg-type]
                            CudaGraphSupport.UNIFORM_BATCH, sizes=[1], max_blocks=1,
                            max_model_len=16, block_size=16, device=torch.device("cpu"))


def test_every_component_of_the_pass_is_asked_before_a_capture(tiny_llama: Path) -> None:
    """On the CPU: the engine's CPU ops say they run their CPU kernels, not CUDA work."""
    with make_llm(tiny_llama, max_num_seqs=4) as llm:
        runner = llm.llm_engine.core.worker.model_runner
        with pytest.raises(NotCapturable, match=r"layers.0.input_layernorm \(custom op "
                                                r"'rms_norm' .*\): it runs forward_cpu"):
            capture_cuda_graphs(runner.model, runner.builder,
                                CudaGraphSupport.UNIFORM_BATCH, sizes=[1, 2],
                                max_blocks=runner.input_batch.block_table.shape[1],
                                max_model_len=256, block_size=16, device=torch.device("cpu"))


def test_decode_steps_replay_padded_graphs_with_the_eager_tokens(tiny_llama: Path) -> None:
    # Requests finish at different steps: decodes of 5, 4, 3, 2, 1 rows. The third (5
    # tokens) leaves from the middle, so a live request moves into its row, and the padding
    # row of the 3-row step held that request's slot the step before: a replay must not
    # write there.
    max_tokens = [12, 3, 5, 12, 9]
    with make_llm(tiny_llama) as llm:
        want = generate(llm, max_tokens)
        core: Any = llm.llm_engine.core
        runner = core.worker.model_runner
        buffers = DecodeBuffers(8, runner.input_batch.block_table.shape[1], 256,
                                torch.device("cpu"))
        replays: Counter[int] = Counter()
        graphs: dict[int, Any] = {}
        for size in capture_sizes(8):
            stand_in = EagerReplay(runner.model, runner.builder, buffers, size, replays)
            graphs[size] = (stand_in, stand_in.hidden)
        runner.step_graph = CudaGraphs(buffers, runner.builder, graphs)
        calls: Counter[str] = Counter()
        original = runner.model.forward

        def forward(*args: Any) -> Any:
            calls["forward"] += 1
            return original(*args)

        runner.model.forward = forward
        got = generate(llm, max_tokens)
    # The tokens exactly; logprobs to rounding (a padded batch is a larger matmul, whose
    # blocking may sum in another order).
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_lps), (_, want_lps) in zip(got, want, strict=True):
        for got_step, want_step in zip(got_lps, want_lps, strict=True):
            assert got_step.keys() == want_step.keys()
            for token, lp in got_step.items():
                assert lp.logprob == pytest.approx(want_step[token].logprob, abs=1e-5)
    # Decodes of 1 row (the prompt alone), then of 5, 4, 3, 2, 1: graphs of 1, 8, 4, 4, 2, 1.
    assert set(replays) == {1, 2, 4, 8}, replays
    # Prefills (and the steps that mix one with decodes) ran eagerly: the stand-ins' own
    # passes are the rest of the forward calls.
    assert calls["forward"] > sum(replays.values())
