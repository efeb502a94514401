"""``cpu``: paged attention in C++ that reads the block table directly; the CPU default.

Decode rows and short prefill chunks (query length up to ``KERNEL_MAX_QUERY``) go to the
native kernel (``native/paged_attention.cpp``): one work item per query row and KV head,
keys and values read in place from their blocks, float32 softmax, OpenMP over torch's
threads. Nothing is gathered, padded or masked, so a step costs what its cached context
does. Longer prefill chunks, where one query row per work item would reread the keys too
often, run as the ``torch`` backend runs them (masked SDPA over gathered blocks). The new
keys and values are written into their slots by the same library.

The backend needs a C++ compiler at first use (the build is cached; see
``native.library``); without one ``supports`` says so and the platform falls back to
``torch``. Select it or the other explicitly with ``--attention-backend cpu|torch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from engine.core.attention import native
from engine.core.attention.torch_backend import SUPPORTED_DTYPES as TORCH_DTYPES
from engine.core.attention.torch_backend import TorchAttentionBackend, attend_groups
from engine.core.attention.torch_grouping import AttentionGroup, build_group, split_prefills
from engine.sdk.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
)
from engine.sdk.support import Support

SUPPORTED_DTYPES = ("float32", "bfloat16")
# Longer prefill chunks run as batched SDPA (see the module docstring); measured in
# benchmarks/attention_cpu.py.
KERNEL_MAX_QUERY = 32


@dataclass(frozen=True)
class CpuAttentionMetadata:
    """One step's layout for the ``cpu`` backend.

    Attributes:
        slots: ``[num_actual_tokens]`` int64 cache slot of each new token.
        block_table: ``[num_reqs, max_blocks]`` int32, rows contiguous.
        rows: int32 query rows the kernel computes; ``requests``/``positions`` give each
            row's request and position (it sees keys ``0..position``).
        requests: int32, as above.
        positions: int32, as above.
        groups: Long prefill chunks, attended as the ``torch`` backend does.
    """

    slots: torch.Tensor
    block_table: torch.Tensor
    rows: torch.Tensor
    requests: torch.Tensor
    positions: torch.Tensor
    groups: tuple[AttentionGroup, ...]


class CpuAttentionMetadataBuilder(AttentionMetadataBuilder[CpuAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        spec = self.ctx.spec
        query_start = common.query_start_loc_cpu.numpy()
        seq_lens = common.seq_lens_cpu.numpy()
        query_lens = np.diff(query_start)
        block_table = common.block_table.contiguous()
        short = query_lens <= KERNEL_MAX_QUERY
        kernel_reqs = np.flatnonzero(short).astype(np.int32)
        counts = query_lens[kernel_reqs]
        requests = np.repeat(kernel_reqs, counts)
        # Row of each kernel query: its request's first row plus its index within the request.
        within = np.arange(len(requests)) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = query_start[requests] + within
        positions = seq_lens[requests] - query_lens[requests] + within
        long_reqs = np.flatnonzero(~short)
        groups = tuple(
            build_group(reqs, query_start, query_lens, seq_lens, block_table, spec.block_size,
                        spec.sliding_window, spec.num_heads // spec.num_kv_heads)
            for reqs in (split_prefills(query_lens, long_reqs) if len(long_reqs) else []))
        return CpuAttentionMetadata(
            slots=common.slot_mapping[: common.num_actual_tokens],
            block_table=block_table,
            rows=torch.from_numpy(rows.astype(np.int32)),
            requests=torch.from_numpy(requests.astype(np.int32)),
            positions=torch.from_numpy(positions.astype(np.int32)),
            groups=groups,
        )


class CpuAttentionImpl(AttentionImpl[CpuAttentionMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kernels = native.load()

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata, output: torch.Tensor,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_tokens = metadata.slots.shape[0]
        self._kernels.write_kv(key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                               metadata.slots)
        scale = self.params.scale
        if metadata.rows.shape[0]:
            self._kernels.paged_attention(
                query, key_cache, value_cache, metadata.block_table, metadata.rows,
                metadata.requests, metadata.positions, output,
                scale if scale is not None else query.shape[-1] ** -0.5,
                self.params.spec.sliding_window)
        if metadata.groups:
            attend_groups(query, key_cache, value_cache, metadata.groups, scale, output)
        return output


class CpuAttentionBackend(AttentionBackend):
    """Paged attention in C++ on the CPU, built on first use (needs a C++ compiler)."""

    name: ClassVar[str] = "cpu"
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return CpuAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return CpuAttentionMetadataBuilder

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                        head_size)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        if spec.platform is not None and spec.platform.device_type != "cpu":
            return Support.no(f"runs on the CPU only, not {spec.platform.device_type}")
        if spec.dtype not in SUPPORTED_DTYPES:
            extra = (" (the torch backend takes it: --attention-backend torch)"
                     if spec.dtype in TORCH_DTYPES else "")
            return Support.no(f"dtype {spec.dtype} not supported; supported: "
                              f"{', '.join(SUPPORTED_DTYPES)}{extra}")
        torch_support = TorchAttentionBackend.supports(spec)
        if not torch_support:  # long prefills run on the torch path
            return torch_support
        try:
            native.load()
        except native.NativeKernelsUnavailable as exc:
            return Support.no(f"the C++ kernels are unavailable: {exc}")
        return Support.yes()
