"""End to end: the engine's logits and greedy tokens equal transformers' on one checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.testing.engine import assert_kv_pool_full, hf_greedy

PROMPTS = [[5, 9, 33, 7], list(range(40, 77)), [300], list(range(100, 117)) * 2]


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
@pytest.mark.parametrize("checkpoint", ["tiny_llama", "tiny_qwen2"])
def test_greedy_tokens_equal_transformers(checkpoint: str, attention_backend: str,
                                          request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=128, in_process=True,
              attention_backend=attention_backend)
    assert llm.llm_engine.core.worker.built.backend.name == attention_backend
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    expected = hf_greedy(path, PROMPTS, 32)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_kv_pool_full(llm)


def test_logprobs_match_transformers(tiny_llama: Path) -> None:
    """Prompt logprobs are log_softmax of the logits: compare them with transformers'."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=64, in_process=True)
    prompt = list(range(10, 30))
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.inference_mode():
        logprobs = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    got = torch.tensor([step[prompt[i]].logprob for i, step in
                        enumerate(out.prompt_logprobs) if step is not None])
    expected = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    # float32 end to end; the difference is summation order (stated bound: 1e-4).
    assert (got - expected).abs().max().item() < 1e-4
