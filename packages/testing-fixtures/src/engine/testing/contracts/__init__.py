"""Published conformance suites: run them in a plugin's own tests against its classes.

.. versionadded:: 1.0
"""

from engine.testing.contracts._batch_sim import (
    BatchSimConfig,
    BatchSimulator,
    SimRequest,
    SimStats,
)
from engine.testing.contracts.logits_processors import (
    ConformanceReport,
    ReferenceFn,
    check_logits_processor,
)

__all__ = [
    "BatchSimConfig",
    "BatchSimulator",
    "ConformanceReport",
    "ReferenceFn",
    "SimRequest",
    "SimStats",
    "check_logits_processor",
]
