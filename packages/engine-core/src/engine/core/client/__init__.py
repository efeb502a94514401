"""Clients of EngineCore: the transport interface and its in-process and gRPC forms.

The types that cross the boundary (``EngineInfo``, ``StepOutputs``, ``EngineDeadError``)
live in :mod:`engine.core.messages`.
"""

from engine.core.client.core_client import EngineCoreClient

__all__ = ["EngineCoreClient"]
