"""The built-in Phi-3 (``engine.core.model_executor.models.phi3``) end to end.

Two tiny random Phi-3 checkpoints written here from ``transformers.Phi3Config`` (fused
``qkv_proj`` and ``gate_up_proj`` tensors, grouped-query attention), in float32:

* ``partial``: ``partial_rotary_factor`` 0.75 (12 of 16 elements of each head rotate) and
  tied embeddings, as Phi-4-mini;
* ``window``: ``sliding_window`` 8 on every layer, so the longer prompts (17 to 50 tokens)
  see only their last 8 keys, as Phi-3-mini's 2047.

For each: the prompt's logits are transformers' within 1e-4 and the greedy tokens equal,
alone and with chunked prefill, prefix-cache hits and preemption, every block free after
each; two tensor-parallel ranks on the ``mp`` executor give one rank's tokens (each rank
cuts its part of q, k, v and of gate, up out of the fused checkpoint tensors); bfloat16 on
the default CPU path is recorded as a step graph. The 128k checkpoints' ``longrope`` is
refused when the model is built.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.model_executor.models.phi3 import Phi3ForCausalLM
from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk.groups import MODELS
from engine.sdk.model import ModelContext
from engine.testing.engine import assert_kv_pool_full, hf_greedy, tokens_and_cached
from engine.testing.tensor_parallel import capture_logits
from engine.testing.test_plugins import entry_installer

ARCH = "Phi3ForCausalLM"
#: ``--model-impl`` naming the class itself: what spawned workers (``mp``) resolve, before
#: the ``engine.models`` entry of engine-core's metadata is installed.
BY_PATH = f"{Phi3ForCausalLM.__module__}:{Phi3ForCausalLM.__qualname__}"
PROMPTS = [[5, 9, 33, 7], list(range(40, 77)), [300], list(range(100, 117)) * 2]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
WINDOW = 8

TINY_PHI3 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "original_max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
VARIANTS = {
    "partial": {"partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    "window": {"sliding_window": WINDOW},
}


def build_tiny_phi3(path: Path, tokenizer_from: Path, seed: int = 0, **changes: Any) -> Path:
    """A random Phi-3 checkpoint (``TINY_PHI3`` with ``changes``), with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(**{**TINY_PHI3, **changes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a larger init spread makes logits (and greedy paths) distinct
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_phi3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              tiny_llama: Path) -> Path:
    name = request.param
    return build_tiny_phi3(tmp_path_factory.mktemp("tiny") / f"phi3-{name}", tiny_llama,
                           **VARIANTS[name])


@pytest.fixture(scope="module")
def hf_tokens(tiny_phi3: Path) -> list[list[int]]:
    return hf_greedy(tiny_phi3, PROMPTS, MAX_TOKENS)


def installed_entry() -> bool:
    """Whether engine-core's installed metadata already has the ``Phi3ForCausalLM`` entry."""
    return any(e.name == ARCH and e.is_builtin
               for e in PluginCatalog.discover().candidates(MODELS, ARCH))


@pytest.fixture
def builtin_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine-core's ``engine.models`` entry for Phi-3, as its pyproject.toml declares it.

    An editable install made before the entry was added does not list it; until it is
    reinstalled, the entry joins what the catalog discovers (in this process only, for
    this test).
    """
    if not installed_entry():
        from engine.core import __version__

        entry_installer(monkeypatch, "engine-core", __version__)(MODELS, ARCH, Phi3ForCausalLM)


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


def test_the_engine_serves_phi3_and_a_plugin_takes_precedence(
        builtin_entry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == BY_PATH

    class PluginPhi3(Phi3ForCausalLM):
        """A third party's Phi-3 (a subclass is enough to tell them apart)."""

    entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")(MODELS, ARCH, PluginPhi3)
    catalog = PluginCatalog.discover()
    assert choose_model(catalog, [ARCH]).entry.distribution == "acme-engine-plugins"
    assert choose_model(catalog, [ARCH], "engine").entry.value == BY_PATH


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
     "original_max_position_embeddings": 64},
    {"type": "su", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
], ids=["longrope", "su"])
def test_long_rope_is_refused_naming_what_is_supported(rope_scaling: dict[str, Any]) -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(**TINY_PHI3, rope_scaling=rope_scaling)
    kind = rope_scaling.get("rope_type") or rope_scaling["type"]
    with pytest.raises(ValueError, match=rf"'{kind}'.*not supported.*default, linear, llama3"):
        Phi3ForCausalLM(ModelContext(hf_config=config, layers=None))


def test_prompt_logits_and_greedy_tokens_equal_transformers(
        builtin_entry: None, tiny_phi3: Path, hf_tokens: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[1]  # 37 tokens: past the window of the ``window`` variant
    with make_llm(tiny_phi3) as llm:
        model = model_of(llm)
        assert type(model) is Phi3ForCausalLM
        captured = capture_logits(model)
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                     use_tqdm=False)
        # One step: the rows predicting prompt tokens 1.., then the last (sampled) row.
        rows = sorted(captured, key=lambda t: -t.shape[0])
        logits = torch.cat(rows)
        assert run(llm, PROMPTS) == hf_tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_phi3, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    assert logits.shape == expected.shape
    # float32 throughout; differences are summation order only.
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert expected.std(-1).min() > 0.5  # logits that are not flat: greedy is no tie
    assert len({tuple(t) for t in hf_tokens}) == len(hf_tokens)


def test_the_variant_is_what_the_checkpoint_says(tiny_phi3: Path) -> None:
    """The knobs really are on: else the tests above would prove nothing about them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_phi3)
    assert config.architectures == [ARCH]
    if tiny_phi3.name.endswith("partial"):
        assert config.rope_parameters["partial_rotary_factor"] == 0.75
        assert config.sliding_window is None
    else:
        assert config.sliding_window == WINDOW < max(len(p) for p in PROMPTS)


def test_chunked_prefill_gives_the_tokens_of_transformers(
        builtin_entry: None, tiny_phi3: Path, hf_tokens: list[list[int]]) -> None:
    with make_llm(tiny_phi3, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert run(llm, PROMPTS) == hf_tokens


def test_prefix_cache_hits_give_the_tokens_of_transformers(
        builtin_entry: None, tiny_phi3: Path) -> None:
    shared = list(range(200, 224))  # 6 full blocks of 4
    prompts = [[*shared, 7, 8, 9], [*shared, 11, 12]]
    expected = hf_greedy(tiny_phi3, prompts, MAX_TOKENS)
    with make_llm(tiny_phi3) as llm:
        first, cached = tokens_and_cached(llm, prompts[:1], GREEDY)
        second, hits = tokens_and_cached(llm, prompts[1:], GREEDY)
        assert cached == [0] and hits == [len(shared)]
        assert first + second == expected
        assert_kv_pool_full(llm)


def test_preemption_gives_the_tokens_of_transformers(
        builtin_entry: None, tiny_phi3: Path, hf_tokens: list[list[int]]) -> None:
    # 16 blocks of 4 tokens cannot hold the four sequences (up to 50 tokens each) at once.
    with make_llm(tiny_phi3, num_kv_blocks=16, max_model_len=64) as llm:
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


def test_two_ranks_on_mp_give_the_tokens_of_one(tiny_phi3: Path,
                                                hf_tokens: list[list[int]]) -> None:
    # Each rank's q, k, v (and gate, up) come from the fused checkpoint tensors: two heads
    # of q and one of k and v per rank. By path: the spawned ranks discover entries from
    # installed metadata themselves.
    options = {"model_impl": BY_PATH, "max_num_batched_tokens": 16}
    with make_llm(tiny_phi3, tensor_parallel_size=2, **options) as tp2:
        assert tp2.llm_engine.core.executor.backend == "mp"
        assert run(tp2, PROMPTS) == hf_tokens


def test_bfloat16_on_the_default_cpu_path_is_a_step_graph(
        builtin_entry: None, tiny_phi3: Path, hf_tokens: list[list[int]]) -> None:
    from engine.kernels.cpu.native import native_kernels

    native = native_kernels()
    if native is None or torch.bfloat16 not in native.packed_matmul_dtypes:
        pytest.skip("no packed bfloat16 product in this build: the model runs eagerly")
    options = {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 32,
               "max_num_batched_tokens": 64}
    with make_llm(tiny_phi3, **options) as llm:
        runner = llm.llm_engine.core.worker.model_runner
        assert type(runner.model) is Phi3ForCausalLM
        assert runner.step_graph is not None
        graph_tokens = run(llm, PROMPTS)
    with make_llm(tiny_phi3, enforce_eager=True, **options) as llm:
        assert run(llm, PROMPTS) == graph_tokens
    # bfloat16 rounds: the first tokens still follow float32 transformers.
    assert [t[:2] for t in graph_tokens] == [t[:2] for t in hf_tokens]
