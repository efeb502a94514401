"""Helpers for tests that run a whole engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def assert_kv_pool_full(llm: Any) -> None:
    """Every KV block is free again (no request holds one): nothing leaked."""
    stats = llm.llm_engine.core.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, (
        f"{stats.num_total_blocks - stats.num_free_blocks} KV blocks still held"
    )
    assert not llm.llm_engine.core.has_unfinished_requests()


def tokens_and_cached(llm: Any, prompts: Sequence[Sequence[int]], params: Any,
                      ) -> tuple[list[list[int]], list[int]]:
    """Generate token-id ``prompts``: each output's token ids, and its ``num_cached_tokens``."""
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outputs],
            [o.num_cached_tokens for o in outputs])


def hf_greedy(path: Path, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations by ``transformers`` (full recompute each step; no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            results.append(out[0, len(prompt):].tolist())
    return results
