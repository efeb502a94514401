"""``LLMEngine``: the synchronous front end, driven step by step.

It validates and tokenizes requests (``InputProcessor``), feeds EngineCore, and turns its
outputs into ``RequestOutput``s (``OutputProcessor``). ``LLM`` drives it to completion;
the server drives the same pieces asynchronously (``AsyncLLM``).

EngineCore runs in its own spawned process behind gRPC (the default, as under
``engine serve``: the front end's tokenization and detokenization overlap the model's
steps), or with ``in_process=True`` in this process with direct calls, where tests and
debuggers reach every seam (``engine.core.worker.built.model``, exceptions in the caller).

Stat loggers (``engine.stat_loggers`` plugins, and the built-in log lines with
``log_stats=True``) get one ``record`` per step that produced outputs, as under
``AsyncLLM``, a ``log()`` every ``log_stats_interval`` seconds from :meth:`step`, and one
``shutdown()`` when the engine stops (:meth:`shutdown`, garbage collection or interpreter
exit). The selected IO processor (``io_processor``) is constructed here too
(:attr:`io_processor`; ``LLM.encode`` runs it).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

from engine.core.client.iteration_stats import IterationStatsTracker
from engine.core.client.stat_loggers import StatLoggerSet, make_stat_loggers
from engine.core.client.sync_client import SyncCoreClient
from engine.core.config import EngineConfig
from engine.core.frontend.front_end import FrontEndParts
from engine.core.frontend.input_processor import ProcessedRequest, PromptType
from engine.core.io_processing import IOProcessorHandle, load_io_processor
from engine.core.messages import EngineInfo
from engine.core.outputs import RequestOutput
from engine.core.plugin_options import check_application_options
from engine.core.rpc.launch import EngineLaunch
from engine.core.startup import EngineSetup, prepare
from engine.sdk.groups import STAT_LOGGERS, TOOL_PARSERS
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import EngineCoreOutput, RequestStatus
from engine.sdk.stats import SchedulerStats

if TYPE_CHECKING:
    from engine.core.engine.engine_core import EngineCore

#: EngineCore as ``LLMEngine`` uses it: in this process, or a spawned one behind gRPC.
CoreHandle = Union["EngineCore", SyncCoreClient]


def _stop(core: CoreHandle, stat_loggers: StatLoggerSet) -> None:
    """Stop EngineCore, then tell the stat loggers (the finalizer: runs once)."""
    try:
        core.shutdown()
    finally:
        stat_loggers.shutdown()

#: Why tool-parser options have no effect under ``LLM``.
NO_TOOL_PARSING = ("LLM parses no tool calls (tool parsers serve `engine serve "
                   "--tool-call-parser`)")


class LLMEngine:
    """Synchronous engine: ``add_request`` then ``step()`` until nothing is unfinished.

    Args:
        config: The engine's options.
        setup: A setup already made by ``prepare(config)`` (default: made here).
        in_process: Run EngineCore in this process (direct calls) instead of its own.
        log_stats: Add the built-in per-request and throughput log lines
            (``LoggingStatLogger``); ``engine.stat_loggers`` plugins are always used.
        log_stats_interval: Seconds between ``StatLogger.log()`` calls (0: never).

    Raises:
        EngineDeadError: EngineCore's process failed to start (with its error).
        ValidationError: a plugin class given as an object cannot be imported by
            EngineCore's process (use ``in_process=True``).
        PluginError: a stat logger or the IO processor failed to load or construct.
    """

    def __init__(self, config: EngineConfig, *, setup: EngineSetup | None = None,
                 in_process: bool = False, log_stats: bool = False,
                 log_stats_interval: float = 10.0) -> None:
        self.config = config
        self.in_process = in_process
        # EngineCore's process starts first: its imports and config reading overlap ours.
        launch = None if in_process else EngineLaunch.spawn(config)
        try:
            self.setup = setup or prepare(config)
            check_application_options(self.setup, TOOL_PARSERS, None, unused=NO_TOOL_PARSING)
            parts = FrontEndParts.build(config, self.setup)
            self.tokenizer, self.eos_token_id = parts.tokenizer, parts.eos_token_id
            self.input_processor = parts.input_processor
            self.output_processor = parts.output_processor
            # Front-end plugins load before any weights do: a broken one stops start-up.
            stat_logger_classes = self.setup.catalog.load_group(STAT_LOGGERS)
            self.io_processor: IOProcessorHandle | None = load_io_processor(self.setup)
            self.core: CoreHandle
            if launch is None:
                from engine.core.engine.engine_core import EngineCore  # in this process

                self.core = EngineCore(self.setup, eos_token_id=self.eos_token_id)
            else:
                from engine.core.rpc import GrpcCoreClient  # grpc: only for this transport

                self.core = SyncCoreClient(GrpcCoreClient.factory(
                    self.setup, self.eos_token_id, launch=launch))
        except BaseException:
            if launch is not None:
                launch.cancel()
            raise
        try:
            info = self._engine_info()
            # EngineCore's scheduler, policy and connector: their extra_args keys.
            self.input_processor.extra_args.take(info.extra_args_keys)
            self.stat_loggers = make_stat_loggers(
                self.setup, info, plugin_classes=stat_logger_classes, log_stats=log_stats)
        except BaseException:
            self.core.shutdown()
            raise
        self._tracker = IterationStatsTracker()
        self._live: dict[str, RequestOutput] = {}  # requests the tracker times
        self._log_stats_interval = log_stats_interval
        self._last_log = time.monotonic()
        # Stop EngineCore (then the stat loggers) when the engine is garbage-collected or
        # at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop, self.core, self.stat_loggers)
        self.stat_loggers.log_engine_initialized()

    def _engine_info(self) -> EngineInfo:
        core = self.core
        return core.info if isinstance(core, SyncCoreClient) else core.info()

    @property
    def _tracks_stats(self) -> bool:
        return bool(self.stat_loggers.loggers)

    @property
    def model_name(self) -> str:
        """The model's display name."""
        return self.setup.source.display_name

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                        *, priority: int = 0) -> ProcessedRequest:
        """Validate and tokenize (raises ``ValidationError`` before anything is queued)."""
        return self.input_processor.process(request_id, prompt, params, priority=priority)

    def add_processed_request(self, request: ProcessedRequest) -> RequestOutput:
        """Queue a request returned by :meth:`process_request`."""
        return self.add_processed_requests([request])[0]

    def add_processed_requests(self, requests: list[ProcessedRequest]) -> list[RequestOutput]:
        """Queue requests returned by :meth:`process_request` (one message to EngineCore)."""
        outputs = [self.output_processor.add_request(request) for request in requests]
        children = [child for request in requests for child in request.children]
        try:
            self.core.add_requests(children)
        except BaseException:
            for request in requests:
                self.output_processor.abort_request(request.request_id)
            raise
        if self._tracks_stats:
            for request, output in zip(requests, outputs, strict=True):
                arrival = request.children[0].arrival_time if request.children else 0.0
                self._tracker.add_request(
                    request.request_id, [c.request_id for c in request.children],
                    len(request.prompt_token_ids), arrival or time.time())
                self._live[request.request_id] = output
        return outputs

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    *, priority: int = 0) -> RequestOutput:
        """Validate, tokenize and queue one request; returns its live output object."""
        return self.add_processed_request(
            self.process_request(request_id, prompt, params, priority=priority))

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its choices); its KV blocks are freed."""
        self.core.abort_requests(self.output_processor.abort_request(request_id))
        output = self._live.pop(request_id, None)
        if output is not None:
            now = time.time()
            self._tracker.finish(output, now, reason="abort")
            self.stat_loggers.record(None, self._tracker.take(now))

    def has_unfinished_requests(self) -> bool:
        """True while a request is in flight."""
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests whose output changed."""
        outputs, scheduler_stats = self._core_step()
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            self.core.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        if self._tracks_stats and (outputs or scheduler_stats is not None):
            self._record_stats(outputs, processed.request_outputs, scheduler_stats)
        return processed.request_outputs

    def _core_step(self) -> tuple[list[EngineCoreOutput], SchedulerStats | None]:
        """One step's outputs, with the scheduler's stats when a stat logger wants them."""
        core = self.core
        if isinstance(core, SyncCoreClient):  # EngineCore's loop sent its stats along
            step = core.step_outputs()
            return ([], None) if step is None else (list(step.outputs), step.scheduler_stats)
        outputs = core.step()
        # make_stats counts preemptions and prefix hits since its last call: only ask for
        # them when someone records them.
        stats = core.make_stats() if outputs and self._tracks_stats else None
        return outputs, stats

    def _record_stats(self, outputs: list[EngineCoreOutput],
                      request_outputs: list[RequestOutput],
                      scheduler_stats: SchedulerStats | None) -> None:
        now = time.time()
        self._tracker.on_outputs(outputs, now)
        for output in request_outputs:
            if output.finished and self._live.pop(output.request_id, None) is not None:
                self._tracker.finish(output, now)
        self.stat_loggers.record(scheduler_stats, self._tracker.take(now))
        interval = self._log_stats_interval
        if interval > 0 and time.monotonic() - self._last_log >= interval:
            self._last_log = time.monotonic()
            self.stat_loggers.log()

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call a worker-extension method on every worker; one result per rank (in order).

        Raises:
            CollectiveRpcError: unknown method, an exception on a rank, or the timeout.
        """
        return self.core.collective_rpc(method, args, kwargs, timeout)

    def shutdown(self) -> None:
        """Stop the engine (and EngineCore's process), then the stat loggers; idempotent."""
        self._finalizer()
