"""The built-in Qwen3 (``engine.core.model_executor.models.qwen3``) end to end.

On engine.testing's tiny random Qwen3 (per-head q/k norms of random weights, ``head_dim`` 32
where ``hidden_size / num_attention_heads`` is 16, untied head), in float32: the prompt's
logits are transformers' within 1e-4 and the greedy tokens equal, alone and with chunked
prefill, prefix-cache hits and preemption, every block free after each; two tensor-parallel
ranks on the ``mp`` executor give one rank's tokens; bfloat16 on the default CPU path is
recorded as a step graph. Which class serves the architecture: the engine's, unless a
plugin registers one (``--model-impl``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.model_executor.models.qwen3 import Qwen3ForCausalLM
from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk.groups import MODELS
from engine.testing.engine import assert_kv_pool_full, hf_greedy, tokens_and_cached
from engine.testing.tensor_parallel import capture_logits
from engine.testing.test_plugins import entry_installer

ARCH = "Qwen3ForCausalLM"
#: ``--model-impl`` naming the class itself: what spawned workers (``mp``) resolve, before
#: the ``engine.models`` entry of engine-core's metadata is installed.
BY_PATH = f"{Qwen3ForCausalLM.__module__}:{Qwen3ForCausalLM.__qualname__}"
PROMPTS = [[5, 9, 33, 7], list(range(40, 77)), [300], list(range(100, 117)) * 2]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def installed_entry() -> bool:
    """Whether engine-core's installed metadata already has the ``Qwen3ForCausalLM`` entry."""
    return any(e.name == ARCH and e.is_builtin
               for e in PluginCatalog.discover().candidates(MODELS, ARCH))


@pytest.fixture
def builtin_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine-core's ``engine.models`` entry for Qwen3, as its pyproject.toml declares it.

    An editable install made before the entry was added does not list it; until it is
    reinstalled, the entry joins what the catalog discovers (in this process only, for
    this test).
    """
    if not installed_entry():
        from engine.core import __version__

        entry_installer(monkeypatch, "engine-core", __version__)(MODELS, ARCH, Qwen3ForCausalLM)


@pytest.fixture(scope="module")
def hf_tokens(tiny_qwen3: Path) -> list[list[int]]:
    return hf_greedy(tiny_qwen3, PROMPTS, MAX_TOKENS)


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


def test_the_engine_serves_qwen3_and_a_plugin_takes_precedence(
        builtin_entry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == BY_PATH

    class PluginQwen3(Qwen3ForCausalLM):
        """A third party's Qwen3 (a subclass is enough to tell them apart)."""

    entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")(MODELS, ARCH, PluginQwen3)
    catalog = PluginCatalog.discover()
    assert choose_model(catalog, [ARCH]).entry.distribution == "acme-engine-plugins"
    assert choose_model(catalog, [ARCH], "engine").entry.value == BY_PATH


def test_prompt_logits_and_greedy_tokens_equal_transformers(
        builtin_entry: None, tiny_qwen3: Path, hf_tokens: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[1]
    with make_llm(tiny_qwen3) as llm:
        model = model_of(llm)
        assert type(model) is Qwen3ForCausalLM
        captured = capture_logits(model)
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                     use_tqdm=False)
        # One step: the rows predicting prompt tokens 1.., then the last (sampled) row.
        rows = sorted(captured, key=lambda t: -t.shape[0])
        logits = torch.cat(rows)
        assert run(llm, PROMPTS) == hf_tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    assert logits.shape == expected.shape
    # float32 throughout; differences are summation order only.
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert expected.std(-1).min() > 0.5  # logits that are not flat: greedy is no tie
    assert len({tuple(t) for t in hf_tokens}) == len(hf_tokens)


def test_chunked_prefill_gives_the_tokens_of_transformers(
        builtin_entry: None, tiny_qwen3: Path, hf_tokens: list[list[int]]) -> None:
    with make_llm(tiny_qwen3, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert run(llm, PROMPTS) == hf_tokens


def test_prefix_cache_hits_give_the_tokens_of_transformers(
        builtin_entry: None, tiny_qwen3: Path) -> None:
    shared = list(range(200, 224))  # 6 full blocks of 4
    prompts = [[*shared, 7, 8, 9], [*shared, 11, 12]]
    expected = hf_greedy(tiny_qwen3, prompts, MAX_TOKENS)
    with make_llm(tiny_qwen3) as llm:
        first, cached = tokens_and_cached(llm, prompts[:1], GREEDY)
        second, hits = tokens_and_cached(llm, prompts[1:], GREEDY)
        assert cached == [0] and hits == [len(shared)]
        assert first + second == expected
        assert_kv_pool_full(llm)


def test_preemption_gives_the_tokens_of_transformers(
        builtin_entry: None, tiny_qwen3: Path, hf_tokens: list[list[int]]) -> None:
    # 16 blocks of 4 tokens cannot hold the four sequences (up to 50 tokens each) at once.
    with make_llm(tiny_qwen3, num_kv_blocks=16, max_model_len=64) as llm:
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


def test_two_ranks_on_mp_give_the_tokens_of_one(tiny_qwen3: Path,
                                                hf_tokens: list[list[int]]) -> None:
    # By path: the spawned ranks discover entries from installed metadata themselves.
    options = {"model_impl": BY_PATH, "max_num_batched_tokens": 16}
    with make_llm(tiny_qwen3, tensor_parallel_size=2, **options) as tp2:
        assert tp2.llm_engine.core.executor.backend == "mp"
        assert run(tp2, PROMPTS) == hf_tokens


def test_bfloat16_on_the_default_cpu_path_is_a_step_graph(
        builtin_entry: None, tiny_qwen3: Path, hf_tokens: list[list[int]]) -> None:
    from engine.kernels.cpu.native import native_kernels

    native = native_kernels()
    if native is None or torch.bfloat16 not in native.packed_matmul_dtypes:
        pytest.skip("no packed bfloat16 product in this build: the model runs eagerly")
    options = {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 32,
               "max_num_batched_tokens": 64}
    with make_llm(tiny_qwen3, **options) as llm:
        runner = llm.llm_engine.core.worker.model_runner
        assert type(runner.model) is Qwen3ForCausalLM
        assert runner.step_graph is not None
        graph_tokens = run(llm, PROMPTS)
    with make_llm(tiny_qwen3, enforce_eager=True, **options) as llm:
        assert run(llm, PROMPTS) == graph_tokens
    # bfloat16 rounds: the first tokens still follow float32 transformers.
    assert [t[:2] for t in graph_tokens] == [t[:2] for t in hf_tokens]
