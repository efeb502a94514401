"""``EngineCore``: the busy loop's body: schedule -> execute -> update_from_output.

EngineCore owns the scheduler (with its policy and the KV-cache manager) and the
:class:`~engine.core.executor.Executor` that runs the workers (in this process, in worker
processes, or as Ray actors). It exchanges only SDK data contracts with both, so where the
workers run changes nothing here.

With ``--kv-connector NAME`` it also builds the connector's scheduler side, after the
executor has sized the KV cache (each worker builds its own worker side then), and hands
it to the scheduler in ``SchedulerContext.kv_connector``; the connector class is loaded
first, so an unknown or broken connector stops start-up before any weight is read.

A plugin that raises while a step runs fails the requests it was serving, not the engine:
the workers report them in ``ModelRunnerOutput.failed``, and ``step`` ends each with
``FINISHED_ERROR`` (its blocks freed, nothing it wrote left in the prefix cache) and an
output whose ``error`` names the plugin; the failure is logged once per step, listing the
requests. Everyone else's tokens of that step are delivered as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from engine.core.engine.scheduler_factory import make_scheduler
from engine.core.executor import Executor, make_executor
from engine.core.extra_args_keys import engine_core_keys
from engine.core.kv_connectors import (
    construct_kv_connector_side,
    kv_connector_context,
    kv_connector_options,
    load_kv_connector,
    scheduler_geometry,
)
from engine.core.messages import EngineInfo
from engine.core.startup import EngineSetup
from engine.core.structured_output import StructuredOutputManager
from engine.core.tokenizer.loader import load_tokenizer
from engine.sdk.errors import PluginFailure
from engine.sdk.kv_connector import KVConnectorRole, KVConnectorScheduler
from engine.sdk.scheduler import EngineCoreOutput, EngineRequest, RequestStatus
from engine.sdk.stats import SchedulerStats

logger = logging.getLogger("engine.core")

#: How long a step with nothing but grammars being compiled waits for one (seconds).
GRAMMAR_WAIT_S = 0.005


class EngineCore:
    """Scheduler + executor; one ``step()`` is one forward pass.

    Args:
        setup: The resolved engine setup.
        eos_token_id: The id that ends generation (for the workers' samplers).
        executor: The executor to use (default: the one ``--distributed-executor-backend``
            selects, started here).
    """

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None,
                 executor: Executor | None = None) -> None:
        self.setup = setup
        connector_cls = load_kv_connector(setup)  # fails before the workers load weights
        connector_options = (kv_connector_options(setup, connector_cls)
                             if connector_cls is not None else None)
        self.executor = executor or make_executor(setup, eos_token_id=eos_token_id)
        self.kv_connector: KVConnectorScheduler | None = None
        try:
            # Every rank's cache has one more block than the scheduler hands out: block 0
            # is the null block.
            self.num_blocks = self.executor.num_blocks - 1
            if connector_cls is not None and connector_options is not None:
                ctx = kv_connector_context(
                    setup, KVConnectorRole.SCHEDULER,
                    scheduler_geometry(setup, self.executor.num_blocks), connector_options)
                side = construct_kv_connector_side(setup, connector_cls, ctx)
                assert isinstance(side, KVConnectorScheduler)
                self.kv_connector = side
            self.scheduler = make_scheduler(setup, self.num_blocks,
                                            kv_connector=self.kv_connector)
            self.structured_output = StructuredOutputManager(
                setup, () if eos_token_id is None else (eos_token_id,),
                lambda: load_tokenizer(setup.source, setup.config.chat_template).hf_tokenizer)
        except BaseException:
            self._shutdown_connector()
            self.executor.shutdown()
            raise

    @property
    def worker(self) -> Any:
        """The worker of the ``uni`` executor (tests and debuggers reach the model here).

        Raises:
            AttributeError: the workers run in other processes.
        """
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            raise AttributeError(
                f"EngineCore.worker exists only with the uni executor; this engine runs "
                f"its workers with {self.setup.config.executor_backend!r} (use "
                f"collective_rpc to reach them)")
        return worker

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (validated and tokenized by the front end).

        One with structured outputs reaches the scheduler once its grammar is compiled.
        """
        if not self.structured_output.add_request(request):
            self.scheduler.add_request(request)

    def add_requests(self, requests: Iterable[EngineRequest]) -> None:
        """Queue several requests."""
        for request in requests:
            self.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests now; their blocks are freed."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests with ``status`` (e.g. a stop string found by the front end)."""
        ids = list(request_ids)
        self.structured_output.forget(ids)
        self.scheduler.finish_requests(ids, status)

    def has_unfinished_requests(self) -> bool:
        """True while some request waits (for the scheduler or its grammar) or runs."""
        return (self.scheduler.has_unfinished_requests()
                or self.structured_output.has_pending())

    def has_work(self) -> bool:
        """True while a step has work: requests to run, or finished ones to report."""
        return (self.has_unfinished_requests()
                or self.scheduler.has_finished_requests())

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute and update once; returns the step's per-request outputs."""
        if not self.has_work():
            return []
        so = self.structured_output
        compiled: list[EngineCoreOutput] = []
        if so.has_pending():
            ready, compiled = so.ready()
            for request in ready:
                self.scheduler.add_request(request)
            if not (self.scheduler.has_unfinished_requests()
                    or self.scheduler.has_finished_requests()):
                if not compiled:  # only grammars in the making: wait for one, briefly
                    so.wait_pending(GRAMMAR_WAIT_S)
                return compiled
        scheduler_output = self.scheduler.schedule()
        bitmask, failed = so.grammar_bitmask(scheduler_output)
        if bitmask is not None:
            scheduler_output = replace(scheduler_output, grammar_bitmask=bitmask)
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        failed = {**failed, **runner_output.failed}
        refused, complete = so.accept([o for o in outputs if o.request_id not in failed])
        failed.update(refused)
        if complete:
            outputs = self._stop_complete(outputs, complete)
        if failed:
            outputs = self._fail_requests(outputs, failed)
        so.forget(o.request_id for o in outputs if o.finish_reason is not None)
        return compiled + outputs

    def _stop_complete(self, outputs: list[EngineCoreOutput],
                       request_ids: list[str]) -> list[EngineCoreOutput]:
        """Stop requests whose grammar is complete (e.g. with ``ignore_eos``)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        done = set(request_ids)
        return [replace(o, finish_reason="stop") if o.request_id in done else o
                for o in outputs]

    def _fail_requests(self, outputs: list[EngineCoreOutput],
                       failed: Mapping[str, PluginFailure]) -> list[EngineCoreOutput]:
        """End the requests a plugin failed this step; their outputs replace any others."""
        self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ERROR)
        by_failure: dict[PluginFailure, list[str]] = {}
        for request_id, failure in failed.items():
            by_failure.setdefault(failure, []).append(request_id)
        for failure, request_ids in by_failure.items():
            logger.error("%s; failing %d request(s) of this step: %s", failure.message,
                         len(request_ids), ", ".join(request_ids[:8])
                         + (", ..." if len(request_ids) > 8 else ""))
        kept = [out for out in outputs if out.request_id not in failed]
        return kept + [EngineCoreOutput(request_id=request_id, new_token_ids=(),
                                        finish_reason="error", error=failure)
                       for request_id, failure in failed.items()]

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call a worker-extension method on every worker; one result per rank, in order.

        Raises:
            CollectiveRpcError: unknown method, an exception on a rank, or the timeout.
        """
        return self.executor.collective_rpc(method, args, kwargs, timeout)

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback`` (from any thread) when a worker dies between or during steps."""
        self.executor.register_failure_callback(callback)

    def info(self) -> EngineInfo:
        """What a front end learns once this EngineCore is up."""
        setup = self.setup
        return EngineInfo(model_name=setup.source.display_name,
                          max_model_len=setup.max_model_len, num_kv_blocks=self.num_blocks,
                          block_size=setup.block_size, vocab_size=setup.vocab_size,
                          tensor_parallel_size=setup.config.tensor_parallel_size,
                          executor_backend=setup.config.executor_backend,
                          extra_args_keys=engine_core_keys(setup))

    def make_stats(self) -> SchedulerStats:
        """The scheduler's current stats."""
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop cached blocks not in use."""
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the scheduler, the connector's scheduler side and the workers (idempotent)."""
        try:
            self.structured_output.shutdown()
            self.scheduler.shutdown()
        finally:
            try:
                self._shutdown_connector()
            finally:
                self.executor.shutdown()

    def _shutdown_connector(self) -> None:
        connector, self.kv_connector = self.kv_connector, None
        if connector is not None:
            try:
                connector.shutdown()
            except Exception:
                logger.exception("KV connector %r: shutdown of its scheduler side failed",
                                 self.setup.config.kv_connector)
