"""The built-in Mixtral (``engine.core.model_executor.models.mixtral``) end to end.

On a tiny random Mixtral (2 layers of 4 SwiGLU experts, top 2, untied head), in float32:
the prompt's logits are transformers' within 1e-4 and the greedy tokens equal, alone and
with chunked prefill, prefix-cache hits and preemption, every block free after each; two
tensor-parallel ranks on the ``mp`` executor (each expert's intermediate size split) give
one rank's tokens; the experts run the ``fused_moe`` custom op, which a plugin replaces;
the built-in op keeps the model eager on the CPU step graph, saying why.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.model_executor.layers.builtin_ops import FusedMoE
from engine.core.model_executor.models.mixtral import MixtralForCausalLM
from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk.groups import CUSTOM_OPS, MODELS
from engine.sdk.ops import FusedMoEOp
from engine.testing.engine import assert_kv_pool_full, hf_greedy, tokens_and_cached
from engine.testing.tensor_parallel import capture_logits
from engine.testing.test_plugins import entry_installer

ARCH = "MixtralForCausalLM"
#: ``--model-impl`` naming the class itself: what spawned workers (``mp``) resolve, before
#: the ``engine.models`` entry of engine-core's metadata is installed.
BY_PATH = f"{MixtralForCausalLM.__module__}:{MixtralForCausalLM.__qualname__}"
PROMPTS = [[5, 9, 33, 7], list(range(40, 77)), [300], list(range(100, 117)) * 2]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def installed_entry() -> bool:
    """Whether engine-core's installed metadata already has the ``MixtralForCausalLM`` entry."""
    return any(e.name == ARCH and e.is_builtin
               for e in PluginCatalog.discover().candidates(MODELS, ARCH))


@pytest.fixture
def builtin_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine-core's ``engine.models`` entry for Mixtral, as its pyproject.toml declares it.

    An editable install made before the entry was added does not list it; until it is
    reinstalled, the entry joins what the catalog discovers (in this process only).
    """
    if not installed_entry():
        from engine.core import __version__

        entry_installer(monkeypatch, "engine-core", __version__)(MODELS, ARCH,
                                                                 MixtralForCausalLM)


@pytest.fixture(scope="module")
def hf_tokens(tiny_mixtral: Path) -> list[list[int]]:
    return hf_greedy(tiny_mixtral, PROMPTS, MAX_TOKENS)


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 128,
                               "in_process": True, "plugins": "none"}
    return LLM(str(path), **{**options, **kwargs})


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    tokens, _ = tokens_and_cached(llm, prompts, GREEDY)
    assert_kv_pool_full(llm)
    return tokens


def model_of(llm: LLM) -> Any:
    return llm.llm_engine.core.worker.model_runner.model


def test_the_engine_serves_mixtral(builtin_entry: None) -> None:
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == BY_PATH


def test_prompt_logits_and_greedy_tokens_equal_transformers(
        builtin_entry: None, tiny_mixtral: Path, hf_tokens: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[1]
    with make_llm(tiny_mixtral) as llm:
        model = model_of(llm)
        assert type(model) is MixtralForCausalLM
        experts = model.layers[0].mlp.experts
        assert type(experts.op) is FusedMoE
        assert experts.op.w13.shape == (4, 2 * 96, 64) and experts.op.w2.shape == (4, 64, 96)
        captured = capture_logits(model)
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                     use_tqdm=False)
        rows = sorted(captured, key=lambda t: -t.shape[0])
        logits = torch.cat(rows)
        assert run(llm, PROMPTS) == hf_tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert expected.std(-1).min() > 0.5  # logits that are not flat: greedy is no tie
    assert len({tuple(t) for t in hf_tokens}) == len(hf_tokens)


def test_chunked_prefill_gives_the_tokens_of_transformers(
        builtin_entry: None, tiny_mixtral: Path, hf_tokens: list[list[int]]) -> None:
    with make_llm(tiny_mixtral, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert run(llm, PROMPTS) == hf_tokens


def test_prefix_cache_hits_give_the_tokens_of_transformers(
        builtin_entry: None, tiny_mixtral: Path) -> None:
    shared = list(range(200, 224))  # 6 full blocks of 4
    prompts = [[*shared, 7, 8, 9], [*shared, 11, 12]]
    expected = hf_greedy(tiny_mixtral, prompts, MAX_TOKENS)
    with make_llm(tiny_mixtral) as llm:
        first, cached = tokens_and_cached(llm, prompts[:1], GREEDY)
        second, hits = tokens_and_cached(llm, prompts[1:], GREEDY)
        assert cached == [0] and hits == [len(shared)]
        assert first + second == expected
        assert_kv_pool_full(llm)


def test_preemption_gives_the_tokens_of_transformers(
        builtin_entry: None, tiny_mixtral: Path, hf_tokens: list[list[int]]) -> None:
    # 16 blocks of 4 tokens cannot hold the four sequences (up to 50 tokens each) at once.
    with make_llm(tiny_mixtral, num_kv_blocks=16, max_model_len=64) as llm:
        scheduler = llm.llm_engine.core.scheduler
        original = scheduler.schedule
        preempted = 0

        def counting_schedule() -> Any:
            nonlocal preempted
            out = original()
            preempted += len(out.preempted_req_ids)
            return out

        scheduler.schedule = counting_schedule
        assert run(llm, PROMPTS) == hf_tokens
        assert preempted > 0


def test_two_ranks_on_mp_give_the_tokens_of_one(tiny_mixtral: Path,
                                                hf_tokens: list[list[int]]) -> None:
    # By path: the spawned ranks discover entries from installed metadata themselves.
    options = {"model_impl": BY_PATH, "max_num_batched_tokens": 16}
    with make_llm(tiny_mixtral, tensor_parallel_size=2, **options) as tp2:
        assert tp2.llm_engine.core.executor.backend == "mp"
        assert run(tp2, PROMPTS) == hf_tokens


class CountingFusedMoE(FusedMoEOp):
    """A plugin's ``fused_moe`` with a CPU path of its own: counts its calls."""

    calls: ClassVar[int] = 0

    def forward_cpu(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return self.forward_native(hidden, router_logits)


def test_a_plugin_replaces_fused_moe(monkeypatch: pytest.MonkeyPatch, tiny_mixtral: Path,
                                     builtin_entry: None, hf_tokens: list[list[int]]) -> None:
    entry_installer(monkeypatch, "acme-moe", "0.1.0")(CUSTOM_OPS, "fused_moe",
                                                      CountingFusedMoE)
    plugins = "engine-core,acme-moe"
    with make_llm(tiny_mixtral, plugins=plugins) as llm:
        ops = [layer.mlp.experts.op for layer in model_of(llm).layers]
        # The entry is imported by its path: this module's class, possibly a second copy.
        used = type(ops[0])
        assert used.__qualname__ == "CountingFusedMoE" and issubclass(used, FusedMoEOp)
        assert all(type(op) is used and op.dispatch_key == "cpu" for op in ops)
        used.calls = 0
        assert run(llm, PROMPTS) == hf_tokens
    assert used.calls > 0  # reached, and its results are the reference's
    # The operator turns it off: the built-in again, never called.
    used.calls = 0
    with make_llm(tiny_mixtral, plugins=plugins, custom_ops=["-fused_moe"]) as llm:
        assert type(model_of(llm).layers[0].mlp.experts.op) is FusedMoE
        assert run(llm, PROMPTS[:1]) == hf_tokens[:1]
    assert used.calls == 0


def test_the_built_in_op_keeps_the_cpu_step_graph_off_saying_why(
        builtin_entry: None, tiny_mixtral: Path, hf_tokens: list[list[int]],
        caplog: pytest.LogCaptureFixture) -> None:
    from engine.kernels.cpu.native import native_kernels

    native = native_kernels()
    if native is None or torch.float32 not in native.packed_matmul_dtypes:
        pytest.skip("no packed float32 product in this build: every model runs eagerly")
    with caplog.at_level(logging.INFO, logger="engine.core.worker.step_graph"), make_llm(
            tiny_mixtral, plugins=None) as llm:
        assert llm.llm_engine.core.worker.model_runner.step_graph is None
        assert run(llm, PROMPTS) == hf_tokens
    lines = [r.message for r in caplog.records if "CPU step graph" in r.message]
    assert len(lines) == 1, lines
    assert "not used, the model runs eagerly" in lines[0]
    assert "custom op 'fused_moe'" in lines[0] and "no graph can record" in lines[0]
