"""``triton``: paged attention for CUDA devices with Triton kernels (``paged_kernels``).

Per step and layer: ``reshape_and_cache`` writes the step's keys and values into their
slots, then one ``paged_attention`` launch computes every row of the batch (prefills,
chunked prefills over a cached prefix, decodes) reading the cache through the block
table. The metadata is the engine's common layout as it is: the builder copies nothing and
reads nothing on the host, so a step costs two kernel launches per layer.

CUDA graphs: ``UNIFORM_BATCH``. The launches depend on the host only through the batch's
``num_tokens``, ``num_reqs`` (grid sizes) and whether it is decode-only (tile shape);
every per-request value (query starts, context lengths, block ids, slots) is read by the
kernels from device memory, and no launch synchronises or allocates. So a graph captured
for a batch replays correctly for any batch with the same token and request counts whose
requests all have one query length (plain decode, or decode with speculative tokens),
provided the engine keeps the metadata in the tensors it captured with (its side of any
graph contract). A mixed prefill/decode batch may pick the other tile shape: not
``ALWAYS``.

Where it runs (``supports``): CUDA devices of compute capability 8.0 or newer for
bfloat16 (7.0 for float16/float32), with triton installed; and CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how its tests run without a GPU.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine.kernels._triton import device_problem
from engine.kernels.attention.batch import PagedBatch
from engine.kernels.attention_spec import ANSWERED_SPEC_FIELDS, decoder_support
from engine.sdk.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
)
from engine.sdk.support import Support

DTYPES = ("bfloat16", "float16", "float32")
#: Largest head size (heads are padded to a power of two in registers).
MAX_HEAD_SIZE = 256
#: Largest block size (a key tile may span several blocks; any size up to this works).
MAX_BLOCK_SIZE = 1024


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[PagedBatch]):
    def build(self, common: CommonAttentionMetadata) -> PagedBatch:
        return PagedBatch(
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens,
            block_table=common.block_table, slot_mapping=common.slot_mapping,
            num_reqs=common.num_reqs, num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len)


class TritonAttentionImpl(AttentionImpl[PagedBatch]):
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: PagedBatch, output: torch.Tensor,
    ) -> torch.Tensor:
        from engine.kernels.attention.paged_kernels import paged_attention, reshape_and_cache

        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # Every row, padding included (its slots are in the null block): the write is then
        # the same launch for any batch of this size.
        rows = min(key.shape[0], metadata.slot_mapping.shape[0])
        reshape_and_cache(key[:rows], value[:rows], key_cache, value_cache,
                          metadata.slot_mapping[:rows])
        paged_attention(output, query, key_cache, value_cache, metadata,
                        scale=self.params.scale, sliding_window=self.params.spec.sliding_window)
        return output


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels: the CUDA platform's default backend."""

    name: ClassVar[str] = "triton"
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.UNIFORM_BATCH
    answered_spec_fields: ClassVar[frozenset[str]] = ANSWERED_SPEC_FIELDS

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return TritonAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return TritonAttentionMetadataBuilder

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # Tokens before heads: one token's keys of all heads are contiguous (the KV write
        # stores a row with one store); a key tile reads head_size-long runs.
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        answer = decoder_support(spec, DTYPES)
        if not answer:
            return answer
        if spec.head_size > MAX_HEAD_SIZE:
            return Support.no(f"head size {spec.head_size} not supported; supported: up to "
                              f"{MAX_HEAD_SIZE}")
        if spec.block_size > MAX_BLOCK_SIZE:
            return Support.no(f"block size {spec.block_size} not supported; supported: up "
                              f"to {MAX_BLOCK_SIZE}")
        return _platform_support(spec)


def _platform_support(spec: AttentionSpec) -> Support:
    platform = spec.platform
    device_type = "cuda" if platform is None else platform.device_type
    problem = device_problem(device_type)
    if problem is not None:
        return Support.no(problem)
    capability = None if platform is None else platform.device_capability
    if device_type == "cuda" and capability is not None:
        need = (8, 0) if spec.dtype == "bfloat16" else (7, 0)
        if tuple(capability) < need:
            return Support.no(f"{spec.dtype} needs compute capability >= {need[0]}.{need[1]}, "
                              f"found {capability[0]}.{capability[1]}")
    return Support.yes()
