"""The built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers."""

from __future__ import annotations

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.model_loader import resolve_model
from engine.testing.engine import assert_kv_pool_full

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, in_process=True)


def test_answers_paris(llm: LLM) -> None:
    [out] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert_kv_pool_full(llm)


def test_greedy_token_ids_equal_transformers_on_the_same_gguf(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    source = resolve_model(None)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                               min_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == expected
