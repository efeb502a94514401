"""Worker-extension plugin: per-rank fingerprints and memory use, for ``collective_rpc``.

Uses only what the contract says a worker offers: ``rank``, ``world_size``, ``device``,
``model`` and ``kv_caches``. Public methods and attributes set on the worker carry the
``sdk1_`` prefix; results are JSON-serialisable.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, ClassVar

from engine.sdk import WorkerExtension
from engine_test_plugin_sdk1.counters import count

if TYPE_CHECKING:
    import torch


class Sdk1Inspect(WorkerExtension):
    name: ClassVar[str] = "sdk1_inspect"

    if TYPE_CHECKING:  # what the worker provides
        rank: int
        world_size: int
        device: torch.device
        model: torch.nn.Module
        kv_caches: dict[str, torch.Tensor]

    def init_worker_extension(self) -> None:
        count("sdk1_inspect.init")
        self.sdk1_loaded_fingerprint = self.sdk1_fingerprint()["sha256"]

    def destroy_worker_extension(self) -> None:
        count("sdk1_inspect.destroy")
        self.sdk1_loaded_fingerprint = None

    def sdk1_fingerprint(self) -> dict[str, Any]:
        """A hash of this rank's parameters (names, dtypes, shapes and bytes)."""
        import torch

        count("sdk1_inspect.fingerprint")
        digest = hashlib.sha256()
        for name, param in sorted(self.model.named_parameters(), key=lambda item: item[0]):
            data = param.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            digest.update(f"{name}:{param.dtype}:{tuple(param.shape)}".encode())
            digest.update(data.numpy().tobytes())
        return {"rank": self.rank, "sha256": digest.hexdigest()}

    def sdk1_weights_changed(self) -> bool:
        """True once the weights differ from those present after loading."""
        return bool(self.sdk1_fingerprint()["sha256"] != self.sdk1_loaded_fingerprint)

    def sdk1_memory(self) -> dict[str, Any]:
        """Bytes held by this rank's parameters and KV cache."""
        count("sdk1_inspect.memory")
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv = sum(t.numel() * t.element_size() for t in self.kv_caches.values())
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "parameter_bytes": params, "kv_cache_bytes": kv,
                "kv_cache_layers": sorted(self.kv_caches)}
