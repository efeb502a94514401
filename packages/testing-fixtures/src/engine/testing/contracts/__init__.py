"""Published conformance suites: run them in a plugin's own tests against its classes.

.. versionadded:: 1.0
"""

from engine.testing.contracts._attention_sim import AttentionSim
from engine.testing.contracts._batch_sim import (
    BatchSimConfig,
    BatchSimulator,
    SimRequest,
    SimStats,
)
from engine.testing.contracts._kv_sim import (
    FakeKVWorker,
    KVConnectorDriver,
    KVSimConfig,
)
from engine.testing.contracts._scheduler_sim import (
    FAKE_VOCAB_SIZE,
    FakeWorker,
    SchedulerDriver,
    fake_next_token,
    reference_tokens,
)
from engine.testing.contracts.attention_backends import (
    DEFAULT_ATTENTION_CASES,
    SPEC_OPTION_CASES,
    AttentionBackendReport,
    AttentionCase,
    check_attention_backend,
)
from engine.testing.contracts.kv_connectors import (
    KVConnectorReport,
    check_kv_connector,
)
from engine.testing.contracts.logits_processors import (
    ConformanceReport,
    ReferenceFn,
    check_logits_processor,
)
from engine.testing.contracts.schedulers import (
    SchedulerFactory,
    SchedulerReport,
    check_scheduler,
)

__all__ = [
    "DEFAULT_ATTENTION_CASES",
    "SPEC_OPTION_CASES",
    "FAKE_VOCAB_SIZE",
    "AttentionBackendReport",
    "AttentionCase",
    "AttentionSim",
    "BatchSimConfig",
    "BatchSimulator",
    "ConformanceReport",
    "FakeKVWorker",
    "FakeWorker",
    "KVConnectorDriver",
    "KVConnectorReport",
    "KVSimConfig",
    "ReferenceFn",
    "SchedulerDriver",
    "SchedulerFactory",
    "SchedulerReport",
    "SimRequest",
    "SimStats",
    "check_attention_backend",
    "check_kv_connector",
    "check_logits_processor",
    "check_scheduler",
    "fake_next_token",
    "reference_tokens",
]
