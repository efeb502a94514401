"""``Attention``: the model-side layer that hands q, k, v to the selected backend."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from engine.core.attention.layer_groups import GroupedMetadata
from engine.sdk.attention import AttentionImpl
from engine.sdk.capture import CaptureContext
from engine.sdk.support import Support


class KVLayerHooks(Protocol):
    """The per-layer calls of a KV connector's worker side (the worker binds one)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer's KV for this step is in place."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Start saving the layer's KV after its attention wrote the step's tokens."""


class Attention(nn.Module):
    """One attention layer: reshapes q/k/v and calls the backend's implementation.

    The layer's KV cache is bound by the model runner after the cache is allocated
    (``kv_cache``); until then a forward pass is an error. With a KV connector, the worker
    also binds ``kv_connector``: the layer then waits for the connector's load of its KV
    before attention and hands its cache to the connector's save right after.

    Args:
        impl: The backend's implementation for this layer.
        layer_name: Unique name (the module path), the key of its KV cache.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (GQA when fewer than ``num_heads``).
        head_size: Elements per head.
        tp_rank: This worker's tensor-parallel rank (which heads of a whole checkpoint
            tensor are this layer's).
        tp_size: Tensor-parallel ranks.

    With attention sinks (``impl.params.sinks``, the spec's ``has_sinks``) the layer
    registers that tensor as its parameter ``sinks`` (``[num_heads]`` float32, this rank's
    heads): loading copies into it in place, so the implementation reads the loaded values.

    ``metadata`` is the model's, passed through unchanged: its attention group's metadata,
    or, where the model's layers form several groups (``engine.core.attention.layer_groups``),
    every group's, of which the layer takes its own.
    """

    def __init__(
        self, impl: AttentionImpl[Any], layer_name: str, num_heads: int, num_kv_heads: int,
        head_size: int, *, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.impl = impl
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        sinks = impl.params.sinks
        self.sinks = None if sinks is None else nn.Parameter(sinks, requires_grad=False)
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.kv_cache: torch.Tensor | None = None
        self.kv_connector: KVLayerHooks | None = None

    def load_weight(self, param_name: str, tensor: torch.Tensor,
                    shard: int | None = None) -> None:
        """Copy this rank's heads of the checkpoint's whole ``sinks`` tensor into ``sinks``.

        Raises:
            ValueError: another name, a layer without sinks, or a shape other than
                ``[num_heads * tp_size]``.
        """
        whole = self.num_heads * self.tp_size
        if param_name != "sinks" or shard is not None or self.sinks is None:
            raise ValueError(f"{self.layer_name}: an attention layer loads only 'sinks' (built "
                             f"with sinks=True), got {param_name!r}")
        if tuple(tensor.shape) != (whole,):
            raise ValueError(f"{self.layer_name}.sinks: expected the checkpoint's [{whole}] "
                             f"(one per head), got {tuple(tensor.shape)}")
        start = self.tp_rank * self.num_heads
        with torch.no_grad():
            self.sinks.copy_(tensor[start:start + self.num_heads])

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Yes without a KV connector (the engine asks the implementation too)."""
        if self.kv_connector is not None:
            return Support.no("a KV connector's hooks run in Python around its attention")
        return Support.yes()

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """``[num_tokens, num_heads * head_size]`` attention output for flattened tokens."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: KV cache not bound (model runner bug)")
        if isinstance(metadata, GroupedMetadata):
            metadata = metadata.for_layer(self.layer_name)
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        out = torch.empty_like(q)
        connector = self.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.layer_name)
        self.impl.forward(q, k, v, self.kv_cache, metadata, out)
        if connector is not None:
            connector.save_kv_layer(self.layer_name, self.kv_cache, metadata)
        return out.view(num_tokens, self.num_heads * self.head_size)
