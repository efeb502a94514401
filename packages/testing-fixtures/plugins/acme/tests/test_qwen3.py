"""Qwen3ForCausalLM: the engine's greedy tokens and logprobs equal transformers' on a tiny model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from acme_engine_plugins.qwen3 import Qwen3ForCausalLM

from engine.core import SamplingParams
from engine.testing.engine import assert_kv_pool_full, hf_greedy


def hf_logprobs(checkpoint: Path, sequence: list[int], start: int) -> list[float]:
    """transformers' log-probability of each token of ``sequence`` from index ``start`` on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([sequence])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [logprobs[i - 1, sequence[i]].item() for i in range(start, len(sequence))]


def test_greedy_tokens_and_logprobs_equal_transformers(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    prompts: list[list[int]],
) -> None:
    calls = spy(Qwen3ForCausalLM, "forward")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    with make_llm(tiny_qwen3) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert_kv_pool_full(llm)
    assert calls["forward"] > 0  # the plugin's model served the checkpoint
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens == hf_greedy(tiny_qwen3, prompts, 12)
    assert len({tuple(t) for t in tokens}) == len(tokens)  # not a degenerate model
    for prompt, output in zip(prompts, outputs, strict=True):
        got = [next(iter(step.values())).logprob for step in output.outputs[0].logprobs]
        expected = hf_logprobs(tiny_qwen3, prompt + tokens[prompts.index(prompt)], len(prompt))
        assert got == pytest.approx(expected, abs=1e-4)


def test_a_llama_checkpoint_does_not_reach_it(
    tiny_llama: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    greedy: Callable[..., Any],
) -> None:
    calls = spy(Qwen3ForCausalLM, "__init__")
    with make_llm(tiny_llama) as llm:
        greedy(llm, [[1, 2, 3]], max_tokens=2)
    assert calls["__init__"] == 0


def test_unsupported_config_stops_start_up_naming_the_plugin(
    tmp_path: Path, qwen3_builder: Callable[..., Path], make_llm: Callable[..., Any],
) -> None:
    from engine.sdk import PluginError

    checkpoint = qwen3_builder(tmp_path / "gelu", hidden_act="gelu", num_hidden_layers=1)
    with pytest.raises(PluginError) as info:
        make_llm(checkpoint)
    message = str(info.value)
    assert "plugin 'Qwen3ForCausalLM' (group engine.models, distribution " \
        "acme-engine-plugins" in message
    assert "hidden_act 'silu' only, got 'gelu'" in message
