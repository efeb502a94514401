"""Clients of EngineCore: the transport interface and its in-process and gRPC forms."""

from engine.core.client.core_client import (
    EngineCoreClient,
    EngineDeadError,
    EngineInfo,
    StepOutputs,
)

__all__ = ["EngineCoreClient", "EngineDeadError", "EngineInfo", "StepOutputs"]
