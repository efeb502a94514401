"""Worker extensions for the engine's tests: one that works, two that clash."""

from __future__ import annotations

from typing import Any

from engine.sdk.worker_extension import WorkerExtension


class Inspector(WorkerExtension):
    """Reports what each worker holds; keeps a per-worker counter; can be told to fail."""

    name = "test_inspect"

    def init_worker_extension(self) -> None:
        self.inspector_calls = 0

    def worker_info(self) -> dict[str, Any]:
        """Rank, world size, device, parameter count and KV cache of this worker."""
        self.inspector_calls += 1
        params = sum(p.numel() for p in self.model.parameters())
        caches = self.kv_caches
        first = next(iter(caches.values()))
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "num_params": int(params), "kv_layers": len(caches),
                "kv_cache_shape": list(first.shape), "calls": self.inspector_calls}

    def param_shape(self, name: str) -> list[int]:
        """The shape of parameter ``name`` on this rank (its shard under TP)."""
        return list(dict(self.model.named_parameters())[name].shape)

    def fail(self, message: str) -> None:
        """Raise, to prove an extension's error comes back named and the worker survives."""
        raise RuntimeError(message)


class ClashesWithWorker(WorkerExtension):
    """Defines a method the worker already has: start-up must refuse it."""

    name = "test_clash_worker"

    def execute_model(self, scheduler_output: Any) -> None:
        raise AssertionError("never called")


class ClashesWithInspector(WorkerExtension):
    """Defines a method ``test_inspect`` also defines: start-up must refuse the pair."""

    name = "test_clash_inspect"

    def worker_info(self) -> dict[str, Any]:
        raise AssertionError("never called")
