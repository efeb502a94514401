"""``WorkerExtension``: methods added to every worker, reachable by ``collective_rpc``.

A worker extension is a mixin: the engine builds each worker's class with the selected
extensions as extra bases, so inside an extension method ``self`` is the worker. The
worker's public attributes an extension may use are documented below; a method name that
clashes with a worker attribute (or another extension's) stops start-up with an error
naming both.

.. versionadded:: 1.0
"""

from __future__ import annotations

from typing import ClassVar

from engine.sdk.plugin import Plugin


class WorkerExtension(Plugin):
    """Mixin whose public methods become callable on all workers with ``collective_rpc``.

    Inside a method, ``self`` is the worker, which offers: ``self.rank`` (int),
    ``self.world_size`` (int), ``self.device`` (a ``torch.device``), ``self.model`` (the
    ``torch.nn.Module``) and ``self.kv_caches`` (layer name -> tensor).

    Example::

        class WeightStats(WorkerExtension):
            name = "weight_stats"

            def weight_norm(self) -> float:
                return sum(p.norm().item() for p in self.model.parameters())

        # in the front end:  llm.collective_rpc("weight_norm") -> [norm_rank0, norm_rank1, ...]

    Arguments and return values of extension methods cross process boundaries: keep them
    JSON-serialisable.

    .. versionadded:: 1.0
    """

    name: ClassVar[str] = ""

    def init_worker_extension(self) -> None:
        """Called once per worker after the model is loaded. Default: no-op."""

    def destroy_worker_extension(self) -> None:
        """Called once per worker at shutdown. Default: no-op."""
