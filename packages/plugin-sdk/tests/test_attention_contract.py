"""The attention-backend contract: selection, spec validation, and a reference backend."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.sdk._version import __version__
from engine.sdk.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionImpl,
    AttentionImplParams,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
    select_backend,
)
from engine.sdk.context import PluginContext
from engine.sdk.errors import UnsupportedError
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

CPU = PlatformInfo(name="cpu", device_type="cpu", supported_dtypes=("float32", "bfloat16"))
CUDA = PlatformInfo(name="cuda", device_type="cuda", device_capability=(9, 0))


def make_spec(**changes: Any) -> AttentionSpec:
    base = AttentionSpec(
        num_heads=4,
        num_kv_heads=2,
        head_size=8,
        dtype="float32",
        kv_cache_dtype="float32",
        block_size=4,
        platform=CPU,
    )
    return dataclasses.replace(base, **changes)


# --- a reference paged-attention backend written only from the SDK docstrings -------------


@dataclass(frozen=True)
class RefMetadata:
    common: CommonAttentionMetadata
    block_size: int


class RefBuilder(AttentionMetadataBuilder[RefMetadata]):
    def build(self, common: CommonAttentionMetadata) -> RefMetadata:
        return RefMetadata(common, self.ctx.spec.block_size)


class RefImpl(AttentionImpl[RefMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: RefMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        spec, common = self.params.spec, metadata.common
        n = common.num_actual_tokens
        k_cache = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_size)
        v_cache = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_size)
        k_cache[common.slot_mapping[:n]] = key[:n]
        v_cache[common.slot_mapping[:n]] = value[:n]
        group = spec.num_heads // spec.num_kv_heads
        starts = common.query_start_loc_cpu.tolist()
        for i in range(common.num_reqs):
            seq_len = int(common.seq_lens_cpu[i])
            q = query[starts[i] : starts[i + 1]]
            num_blocks = -(-seq_len // metadata.block_size)
            blocks = common.block_table[i, :num_blocks]
            k = kv_cache[0][blocks].reshape(-1, spec.num_kv_heads, spec.head_size)[:seq_len]
            v = kv_cache[1][blocks].reshape(-1, spec.num_kv_heads, spec.head_size)[:seq_len]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            q_pos = torch.arange(seq_len - q.shape[0], seq_len)
            mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, scale=self.params.scale,
            )
            output[starts[i] : starts[i + 1]] = out.transpose(0, 1)
        return output


class RefBackend(AttentionBackend):
    name = "ref"
    cudagraph_support = CudaGraphSupport.NEVER

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return RefImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return RefBuilder

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        if spec.sliding_window is not None:
            return Support.no("sliding window is not supported")
        if spec.kv_cache_dtype != spec.dtype:
            return Support.no(f"kv_cache_dtype must equal dtype ({spec.dtype})")
        return Support.yes()


def _common(
    query_lens: list[int], seq_lens: list[int], block_ids: list[list[int]], block_size: int
) -> CommonAttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    table = torch.zeros(len(seq_lens), max(map(len, block_ids)), dtype=torch.int32)
    slots = []
    for i, blocks in enumerate(block_ids):
        table[i, : len(blocks)] = torch.tensor(blocks)
        for pos in range(seq_lens[i] - query_lens[i], seq_lens[i]):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq,
        seq_lens_cpu=seq.clone(), block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(seq_lens),
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def test_reference_backend_matches_dense_causal_attention() -> None:
    torch.manual_seed(0)
    spec = make_spec()
    backend = select_backend([RefBackend], spec)
    ctx = AttentionContext(spec=spec, layer_names=("l0",), device="cpu", max_num_reqs=4,
                           max_num_batched_tokens=64, max_model_len=32)
    builder = backend.get_builder_cls()(ctx)
    impl = backend.get_impl_cls()(AttentionImplParams(spec=spec, layer_name="l0", scale=0.3))
    kv_cache = torch.zeros(backend.get_kv_cache_shape(8, spec.block_size, 2, 8))
    # Request A: 8 tokens in blocks [3, 5]; request B: 7 tokens in blocks [1, 6]. Block 0 unused.
    lens, blocks = [8, 7], [[3, 5], [1, 6]]
    q_all = [torch.randn(n, 4, 8) for n in lens]
    k_all = [torch.randn(n, 2, 8) for n in lens]
    v_all = [torch.randn(n, 2, 8) for n in lens]

    def step(ranges: list[tuple[int, int]]) -> torch.Tensor:
        common = _common([b - a for a, b in ranges], [b for _, b in ranges], blocks, 4)
        q = torch.cat([q_all[i][a:b] for i, (a, b) in enumerate(ranges)])
        k = torch.cat([k_all[i][a:b] for i, (a, b) in enumerate(ranges)])
        v = torch.cat([v_all[i][a:b] for i, (a, b) in enumerate(ranges)])
        out = torch.empty_like(q)
        result = impl.forward(q, k, v, kv_cache, builder.build(common), out)
        assert result is out
        return result

    step([(0, 5), (0, 6)])  # prefill chunks
    out = step([(5, 8), (6, 7)])  # A continues its prefill, B decodes
    expected = []
    for i, (a, b) in enumerate([(5, 8), (6, 7)]):
        k = k_all[i][:b].repeat_interleave(2, 1).transpose(0, 1)
        v = v_all[i][:b].repeat_interleave(2, 1).transpose(0, 1)
        mask = torch.ones(b, b, dtype=torch.bool).tril()[a:b]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q_all[i][a:b].transpose(0, 1), k, v, attn_mask=mask, scale=0.3
        )
        expected.append(ref.transpose(0, 1))
    torch.testing.assert_close(out, torch.cat(expected))
    assert kv_cache[:, 0].abs().sum() == 0  # the null block was never written


def test_common_metadata_helpers() -> None:
    common = _common([3, 1], [8, 7], [[3, 5], [1, 6]], 4)
    assert common.query_lens_cpu.tolist() == [3, 1]
    assert not common.is_uniform_decode
    with pytest.raises(dataclasses.FrozenInstanceError):
        common.num_reqs = 3  # type: ignore[misc]


# --- selection -----------------------------------------------------------------------------


class NoBackend(RefBackend):
    name = "never"

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        return Support.no(f"head size {spec.head_size} not in (64, 128)")


class HalfDone(AttentionBackend):
    name = "half_done"

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        return Support.yes()


def test_select_backend_takes_first_supported_in_order() -> None:
    assert select_backend([NoBackend, RefBackend], make_spec()) is RefBackend


def test_select_backend_lists_every_candidate_with_its_reason() -> None:
    spec = make_spec(sliding_window=16)
    with pytest.raises(UnsupportedError) as info:
        select_backend([RefBackend, NoBackend, HalfDone], spec)  # type: ignore[type-abstract]
    names = [name for name, _ in info.value.reasons]
    assert names == ["ref", "never", "half_done"]
    reasons = dict(info.value.reasons)
    assert reasons["ref"] == "sliding window is not supported"
    assert "head size 8" in reasons["never"]
    assert "get_impl_cls" in reasons["half_done"] and "abstract" in reasons["half_done"]
    message = str(info.value)
    assert "sliding_window=16" in message and "  - never: head size 8" in message


def test_select_backend_without_candidates() -> None:
    with pytest.raises(UnsupportedError, match="no attention backend candidates"):
        select_backend([], make_spec())


def test_select_backend_rejects_non_support_answer() -> None:
    class Sloppy(RefBackend):
        name = "sloppy"

        @classmethod
        def supports(cls, spec: AttentionSpec) -> Support:
            return True  # type: ignore[return-value]

    with pytest.raises(TypeError, match="sloppy: supports\\(\\) must return"):
        select_backend([Sloppy], make_spec())


# --- data contracts and base classes --------------------------------------------------------


def test_cudagraph_support_is_ordered_for_min() -> None:
    order = list(CudaGraphSupport)
    assert order == sorted(order)
    assert order[0] is CudaGraphSupport.NEVER and order[-1] is CudaGraphSupport.ALWAYS
    assert min(CudaGraphSupport.ALWAYS, RefBackend.cudagraph_support) is CudaGraphSupport.NEVER
    assert min(CudaGraphSupport.UNIFORM_BATCH, CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE) is (
        CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_heads": 0}, "num_heads must be an integer >= 1"),
        ({"num_kv_heads": 3}, "num_kv_heads \\(3\\) must divide num_heads \\(4\\)"),
        ({"block_size": -1}, "block_size"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_attention_spec_validates(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_spec(**changes)


def test_spec_is_frozen_hashable_and_describes_itself() -> None:
    spec = make_spec(sliding_window=4096, platform=CUDA)
    assert spec == make_spec(sliding_window=4096, platform=CUDA)
    assert hash(spec) == hash(make_spec(sliding_window=4096, platform=CUDA))
    assert "sliding_window=4096" in spec.describe() and "platform=cuda" in spec.describe()


def test_attention_context_is_a_keyword_only_plugin_context() -> None:
    ctx = AttentionContext(spec=make_spec(), layer_names=("a", "b"), device="cpu",
                           max_num_reqs=1, max_num_batched_tokens=1, max_model_len=1)
    assert isinstance(ctx, PluginContext)
    with pytest.raises(TypeError):
        AttentionContext(make_spec(), ("a",), "cpu", 1, 1, 1)  # type: ignore[call-arg, arg-type]


def test_abstract_methods_are_enforced() -> None:
    assert inspect.isabstract(HalfDone)
    assert not inspect.isabstract(RefBackend)

    class NoBuild(AttentionMetadataBuilder[None]):
        pass

    class NoForward(AttentionImpl[None]):
        pass

    ctx = AttentionContext(spec=make_spec(), layer_names=(), device="cpu", max_num_reqs=1,
                           max_num_batched_tokens=1, max_model_len=1)
    with pytest.raises(TypeError, match="build"):
        NoBuild(ctx)  # type: ignore[abstract]
    with pytest.raises(TypeError, match="forward"):
        NoForward(AttentionImplParams(spec=make_spec(), layer_name="x", scale=1.0))  # type: ignore[abstract]


def test_sdk_version_is_recorded() -> None:
    assert RefBackend.sdk_version == __version__

    class Pinned(RefBackend):
        sdk_version = "1.0.0"

    assert Pinned.sdk_version == "1.0.0"


def test_contract_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import engine.sdk.attention, engine.sdk.quantization\n"
        "import engine.sdk.linear_kernel, engine.sdk.kv_connector\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
