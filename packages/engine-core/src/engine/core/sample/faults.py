"""``LogitsFaults``: a logits processor that raises fails only the requests it was serving.

Rank 0's worker calls every processor's ``update_state`` (from ``InputBatch``) and
``apply`` (from the ``Sampler``) through this object. When one raises, it records which
rows (batch slots) failed and why, and the step goes on without that call's result:

* ``RowsFailedError(rows, logits)`` fails those rows only (``PerRequestLogitsProcessor``
  raises it when one request's function raises); sampling continues with its ``logits``.
* Any other exception fails every row of the step: the engine cannot tell which requests
  the processor was serving. Sampling continues with the logits as they were.

``by_request`` turns the rows into the step's ``ModelRunnerOutput.failed``; EngineCore ends
those requests with ``FINISHED_ERROR`` and a message naming the processor, its group and
its distribution. The processor stays in place for later requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.core.plugin_faults import describe
from engine.sdk.errors import PluginError, PluginFailure
from engine.sdk.logits_processor import BatchUpdate, LogitsProcessor, RowsFailedError


class LogitsFaults:
    """The rows the logits processors failed in the step being run.

    Args:
        names: Each processor's plugin name (entry-point name or ``module:Class``).
        error: Builds the ``PluginError`` naming processor ``name`` from a cause.
    """

    def __init__(self, names: dict[int, str], error: Callable[[str, str], PluginError]) -> None:
        self._names = names  # id(processor) -> name
        self._error = error
        self.rows: dict[int, PluginFailure] = {}
        self.every_row: PluginFailure | None = None

    @classmethod
    def for_processors(cls, processors: dict[str, LogitsProcessor],
                       error: Callable[[str, str], PluginError]) -> LogitsFaults:
        """Faults of the processors ``{name: instance}``."""
        return cls({id(p): name for name, p in processors.items()}, error)

    def reset(self) -> None:
        """Forget the previous step's failures (called at the start of every step)."""
        self.rows = {}
        self.every_row = None

    def update_state(self, processor: LogitsProcessor, update: BatchUpdate | None) -> None:
        """``processor.update_state(update)``, recording a failure instead of raising."""
        try:
            processor.update_state(update)
        except RowsFailedError as exc:
            self._fail_rows(processor, "update_state", exc)
        except Exception as exc:  # noqa: BLE001 - the plugin's bug fails its step, not the engine
            self._fail_all(processor, "update_state", exc)

    def apply(self, processor: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
        """``processor.apply(logits)``, recording a failure instead of raising.

        Returns:
            The processed logits; after a failure, the ``RowsFailedError``'s logits or
            ``logits`` as passed in.
        """
        try:
            return processor.apply(logits)
        except RowsFailedError as exc:
            self._fail_rows(processor, "apply", exc)
            return exc.logits if exc.logits is not None else logits
        except Exception as exc:  # noqa: BLE001 - the plugin's bug fails its step, not the engine
            self._fail_all(processor, "apply", exc)
            return logits

    def by_request(self, req_ids: Sequence[str]) -> dict[str, PluginFailure]:
        """The failed requests of the step, ``req_ids`` being the batch's slots in order."""
        if self.every_row is not None:
            return dict.fromkeys(req_ids, self.every_row)
        return {req_ids[row]: failure for row, failure in self.rows.items()
                if 0 <= row < len(req_ids)}

    def _failure(self, processor: LogitsProcessor, hook: str, cause: str) -> PluginFailure:
        name = self._names.get(id(processor), type(processor).__qualname__)
        return PluginFailure.from_error(self._error(name, f"{hook}() raised {cause}"))

    def _fail_rows(self, processor: LogitsProcessor, hook: str, exc: RowsFailedError) -> None:
        for row, cause in exc.rows.items():
            if row not in self.rows:
                self.rows[row] = self._failure(processor, hook, f"{describe(cause)} (for "
                                                                f"this request only)")

    def _fail_all(self, processor: LogitsProcessor, hook: str, exc: Exception) -> None:
        if self.every_row is None:
            self.every_row = self._failure(processor, hook, describe(exc))
