"""On a real GPU: the engine serves with the package's kernels and gives the torch path's tokens.

Marked ``gpu``: skipped without CUDA (see conftest.py). Elsewhere in this package the same
kernels run on CUDA tensors when a GPU is present, and in Triton's interpreter otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from engine.kernels.attention import TritonAttentionBackend
from engine.testing.contracts import check_attention_backend

pytestmark = pytest.mark.gpu


def test_the_backend_conforms_in_bfloat16_on_the_gpu() -> None:
    report = check_attention_backend(TritonAttentionBackend, device="cuda", dtype="bfloat16")
    assert not report.skipped, report.skipped


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_engine_on_cuda_matches_the_torch_backend(tiny_llama_checkpoint: Path,
                                                      quantization: str | None) -> None:
    from engine.core import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 9, 7]}]
    tokens = {}
    for backend, custom_ops in (("triton", ()), ("torch", ("none",))):
        with LLM(str(tiny_llama_checkpoint), dtype="float32", in_process=True,
                 num_kv_blocks=64, attention_backend=backend, custom_ops=custom_ops,
                 quantization=quantization) as llm:
            assert llm.llm_engine.setup.platform.name == "cuda"
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[backend] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens["triton"] == tokens["torch"]


def test_cuda_graphs_replay_decodes_with_the_eager_tokens(
        tiny_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from engine.core import LLM, SamplingParams
    from engine.core.worker.cuda_graphs import CudaGraphs

    replays: list[Any] = []
    original = torch.cuda.CUDAGraph.replay

    def counted(self: Any) -> None:
        replays.append(self)
        original(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    prompts = [{"prompt_token_ids": [3 + i for i in range(n)]} for n in (3, 40, 17, 90, 1)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (12, 3, 5, 12, 9)]  # decodes of 5, 4, 3, 2, 1 rows: padded graphs
    tokens = {}
    for eager in (True, False):
        with caplog.at_level(logging.INFO, logger="engine.core.worker.cuda_graphs"), LLM(
                str(tiny_llama_checkpoint), dtype="float32", in_process=True,
                num_kv_blocks=64, max_num_seqs=8, enforce_eager=eager) as llm:
            graphs = llm.llm_engine.core.worker.model_runner.step_graph  # type: ignore[union-attr]
            assert isinstance(graphs, CudaGraphs) != eager, caplog.text
            assert ("--enforce-eager" if eager else "sizes 1, 2, 4, 8") in caplog.text
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[eager] = [list(o.outputs[0].token_ids) for o in outputs]
            stats = llm.llm_engine.core.make_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
    assert tokens[False] == tokens[True]
    assert len(replays) >= 10  # the decodes replayed graphs


def test_gpu_memory_utilization_sizes_the_kv_cache(tiny_llama_checkpoint: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from engine.core import LLM, SamplingParams

    total = torch.cuda.get_device_properties(0).total_memory
    with caplog.at_level(logging.INFO, logger="engine.worker"), LLM(
            str(tiny_llama_checkpoint), dtype="float32", in_process=True,
            gpu_memory_utilization=0.3) as llm:
        worker = llm.llm_engine.core.worker  # type: ignore[union-attr]
        kv_bytes = sum(c.numel() * c.element_size() for c in worker.kv_caches.values())
        outputs = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4
    assert "KV cache memory: --gpu-memory-utilization 0.3 of" in caplog.text
    # Far more than the 2 GiB default would give, and within the fraction.
    assert 0.1 * total < kv_bytes < 0.3 * total, (kv_bytes, total)
