"""The Llama family and Qwen3, run directly over the paged cache, against transformers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.model_executor.layers import LayerFactory
from engine.core.model_executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from engine.core.model_executor.models.qwen3 import Qwen3ForCausalLM
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.sdk.attention import AttentionContext, CommonAttentionMetadata
from engine.sdk.model import ModelContext
from engine.testing.models import build_tiny_checkpoint

BLOCK = 4


def build(kind: str, tmp_path: Path, backend=TorchAttentionBackend):
    from transformers import AutoModelForCausalLM

    path = build_tiny_checkpoint(tmp_path / kind, kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    factory = LayerFactory(dtype=torch.float32, block_size=BLOCK,
                           attention_backend=backend)
    cls = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}.get(kind, LlamaForCausalLM)
    model = cls(ModelContext(hf_config=hf.config, layers=factory))
    model.load_weights(hf.state_dict().items())
    return hf, model, factory


def run_prefill(model, factory, prompts, num_blocks=64, backend=TorchAttentionBackend):
    """One step computing every prompt in full; returns logits of every token."""
    spec = next(iter(factory.attention_layers.values())).impl.params.spec
    shape = backend.get_kv_cache_shape(num_blocks, BLOCK, spec.num_kv_heads,
                                                     spec.head_size)
    for layer in factory.attention_layers.values():
        layer.kv_cache = torch.zeros(shape)
    next_block = 1
    rows, slots, positions = [], [], []
    max_blocks = max(math.ceil(len(p) / BLOCK) for p in prompts)
    for prompt in prompts:
        blocks = list(range(next_block, next_block + math.ceil(len(prompt) / BLOCK)))
        next_block += len(blocks)
        rows.append(blocks + [0] * (max_blocks - len(blocks)))
        slots += [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(prompt))]
        positions += list(range(len(prompt)))
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, seq_lens_cpu=lens,
        block_table=torch.tensor(rows, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(prompts),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()),
    )
    ctx = AttentionContext(spec=spec, layer_names=tuple(factory.attention_layers),
                           device="cpu", max_num_reqs=8, max_num_batched_tokens=512,
                           max_model_len=256)
    metadata = backend.get_builder_cls()(ctx).build(common)
    input_ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        hidden = model(input_ids, torch.tensor(positions), metadata)
        return model.compute_logits(hidden), qsl


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend],
                         ids=lambda b: b.name)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_prefill_logits_match_transformers(kind: str, backend, tmp_path: Path) -> None:
    hf, model, factory = build(kind, tmp_path, backend)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 17, 1, 9)]
    logits, qsl = run_prefill(model, factory, prompts, backend=backend)
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        got = logits[int(qsl[i]):int(qsl[i + 1])]
        # float32 throughout; differences are summation order only.
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
