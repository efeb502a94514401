"""The gRPC ``Stream``'s end of EngineCore's busy loop: one ``ServerMessage`` per step.

The loop (``engine.core.engine.loop``) calls :meth:`StreamSink.publish` on its thread; the
step is encoded there rather than on the stream's thread, which would have to win the GIL
from the loop mid-step (that costs more than the encoding, ~0.2 ms for 64 requests). The
stream's thread reads the queue until :data:`END_OF_STREAM`.
"""

from __future__ import annotations

import queue
from typing import Any

from engine.core.engine.loop import OutputSink
from engine.core.messages import StepOutputs
from engine.core.rpc import convert
from engine.core.rpc._gen import engine_core_pb2 as pb

#: Put on a sink's queue to end its stream.
END_OF_STREAM = object()


class StreamSink(OutputSink):
    """ServerMessages of one connected ``Stream``, then :data:`END_OF_STREAM`."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def publish(self, step: StepOutputs) -> None:
        self.queue.put(pb.ServerMessage(step=convert.step_outputs_to_proto(
            step.outputs, step.scheduler_stats, step.timestamp)))

    def close(self, error: str | None) -> None:
        if error is not None:
            self.queue.put(pb.ServerMessage(error=pb.EngineError(message=error)))
        self.queue.put(END_OF_STREAM)

    def end(self) -> None:
        """The client went away: let the stream's thread finish."""
        self.queue.put(END_OF_STREAM)
