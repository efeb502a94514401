"""``engine.worker_extensions`` entry ``acme_inspect``: what each worker holds, via collective_rpc.

``LLM(..., worker_extensions=["acme_inspect"])``, then ``llm.collective_rpc("acme_ops")``:
the implementation each custom op of the model was built from, and
``llm.collective_rpc("acme_memory")``: bytes of parameters and KV cache, per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sdk import WorkerExtension

if TYPE_CHECKING:
    import torch


class AcmeInspect(WorkerExtension):
    """Per-rank views of the model and its KV cache (JSON-serialisable answers)."""

    name = "acme_inspect"

    if TYPE_CHECKING:  # what the worker provides
        rank: int
        world_size: int
        device: torch.device
        model: torch.nn.Module
        kv_caches: dict[str, torch.Tensor]

    def acme_ops(self) -> dict[str, Any]:
        """``{"rank", "ops": {op name: sorted "module:Class" of its instances}}``."""
        from engine.sdk.ops import CustomOp

        ops: dict[str, set[str]] = {}
        for module in self.model.modules():
            if isinstance(module, CustomOp):
                cls = type(module)
                ops.setdefault(cls.name, set()).add(f"{cls.__module__}:{cls.__qualname__}")
        return {"rank": self.rank, "ops": {name: sorted(v) for name, v in sorted(ops.items())}}

    def acme_memory(self) -> dict[str, int]:
        """Bytes held by this rank's parameters and KV cache."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv = sum(t.numel() * t.element_size() for t in self.kv_caches.values())
        return {"rank": self.rank, "parameter_bytes": params, "kv_cache_bytes": kv}
