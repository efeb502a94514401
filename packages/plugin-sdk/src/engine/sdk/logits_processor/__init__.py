"""The logits-processor contract: change the logits of the requests that ask for it.

Entry-point group ``engine.logits_processors``; the value is a :class:`LogitsProcessor`
subclass. See ``docs/plugins/logits-processors.md`` for a worked example and
``engine.testing.contracts.check_logits_processor`` for the conformance suite.

.. versionadded:: 1.0
"""

from engine.sdk.logits_processor._batch_update import (
    AddedRequest,
    BatchUpdate,
    MoveDirectionality,
    MovedRequest,
    process_dict_updates,
)
from engine.sdk.logits_processor._interface import LogitsProcessor, LogitsProcessorContext
from engine.sdk.logits_processor._per_request import (
    PerRequestLogitsProcessor,
    RequestLogitsProcessor,
)
from engine.sdk.logits_processor._rows_failed import RowsFailedError

__all__ = [
    "AddedRequest",
    "BatchUpdate",
    "LogitsProcessor",
    "LogitsProcessorContext",
    "MoveDirectionality",
    "MovedRequest",
    "PerRequestLogitsProcessor",
    "RequestLogitsProcessor",
    "RowsFailedError",
    "process_dict_updates",
]
