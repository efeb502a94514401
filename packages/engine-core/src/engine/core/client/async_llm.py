"""``AsyncLLM``: the asynchronous front-end engine the server uses.

It owns the tokenizer, the ``InputProcessor`` (validation, tokenization, ``n`` fan-out)
and the ``OutputProcessor`` (detokenization, stop strings), and talks to EngineCore
through an :class:`~engine.core.client.EngineCoreClient`, whichever transport that is::

    engine = AsyncLLM(EngineConfig(model=path))              # EngineCore in its own process
    engine = AsyncLLM(config, client=in_process_client)      # any transport: a factory
    await engine.start()
    async for output in engine.generate("req-1", "Hello", SamplingParams(max_tokens=8)):
        print(output.outputs[0].text)                        # cumulative, updated in place
    await engine.shutdown()

Validation and tokenization of a prompt run on a :class:`TokenizerPool` thread in
:meth:`add_request_async` and :meth:`generate` (the server's path), so a long prompt does
not stall the event loop; :meth:`add_request` does them on the caller's thread.

One output-handler task reads the client's ``StepOutputs``, applies them to the
``OutputProcessor``, ends stop-string choices in EngineCore (``finish_requests(...,
FINISHED_STOPPED)``), wakes the requests whose output changed, and feeds one
``IterationStats`` per step to every stat logger (``shutdown()`` tells each logger once
that the engine stopped). If EngineCore dies, every request in flight and every later
call fails with ``EngineDeadError``, the stat loggers get an empty snapshot (nothing runs
or holds KV blocks any more) and the periodic log line says the engine is dead, and
:meth:`AsyncLLM.wait_for_death` returns (``engine serve`` then exits with status 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Union

from engine.core.client.core_client import EngineCoreClient
from engine.core.client.iteration_stats import IterationStatsTracker
from engine.core.client.request_stream import RequestStream
from engine.core.client.stat_loggers import (
    StatLoggerFactory,
    StatLoggerSet,
    make_stat_loggers,
    stat_logger_context,
)
from engine.core.config import EngineConfig
from engine.core.frontend.front_end import FrontEndParts
from engine.core.frontend.input_processor import ProcessedRequest, PromptType
from engine.core.frontend.tokenizer_pool import TokenizerPool
from engine.core.messages import EngineDeadError, EngineInfo, StepOutputs
from engine.core.outputs import RequestOutput
from engine.core.startup import EngineSetup, prepare
from engine.core.tokenizer import Tokenizer
from engine.sdk.errors import ValidationError
from engine.sdk.groups import STAT_LOGGERS
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import RequestStatus
from engine.sdk.stats import SchedulerStats

logger = logging.getLogger("engine.core")

#: Builds the transport from the resolved setup and the EOS token id.
CoreClientFactory = Callable[[EngineSetup, Union[int, None]], EngineCoreClient]


def in_process_client(setup: EngineSetup, eos_token_id: int | None) -> EngineCoreClient:
    """The ``--in-process`` transport: EngineCore on a thread of this process."""
    from engine.core.client.in_process import InProcessCoreClient  # EngineCore's code

    return InProcessCoreClient(setup, eos_token_id=eos_token_id)


class AsyncLLM:
    """Front end of one engine; see the module docstring.

    Args:
        config: The engine's options.
        client: The EngineCore transport: a :data:`CoreClientFactory` (called with the
            setup and the EOS id) or a ready :class:`EngineCoreClient`. Default: EngineCore
            in its own spawned process behind gRPC (``GrpcCoreClient.factory``); pass
            :func:`in_process_client` to run it on a thread of this process.
        setup: A setup already made by ``prepare(config)`` (default: made here).
        stat_loggers: More stat loggers by name (the server's Prometheus logger), as
            factories taking a :class:`StatLoggerContext` (see :meth:`add_stat_logger`).
            ``engine.stat_loggers`` plugins are always added.
        log_stats: Add the built-in :class:`LoggingStatLogger` (per-request and throughput
            log lines).
        log_stats_interval: Seconds between throughput lines (``StatLogger.log`` calls).
        served_model_name: The name clients use for the model (``--served-model-name``):
            the stat loggers' ``ctx.model``, so metrics carry it. Default: the model's
            display name.
    """

    def __init__(
        self, config: EngineConfig, *,
        client: EngineCoreClient | CoreClientFactory | None = None,
        setup: EngineSetup | None = None,
        stat_loggers: Mapping[str, StatLoggerFactory] | None = None,
        log_stats: bool = True, log_stats_interval: float = 10.0,
        served_model_name: str | None = None,
    ) -> None:
        self.config = config
        self.setup = setup or prepare(config)
        parts = FrontEndParts.build(config, self.setup)
        self._tokenizer, self.eos_token_id = parts.tokenizer, parts.eos_token_id
        self.input_processor = parts.input_processor
        self.output_processor = parts.output_processor
        #: Runs tokenizer work (encode, chat templates) off the event loop.
        self.tokenizer_pool = TokenizerPool()
        if client is None:
            from engine.core.rpc import GrpcCoreClient

            client = GrpcCoreClient.factory
        self.client = client if isinstance(client, EngineCoreClient) else client(
            self.setup, self.eos_token_id)
        self._stat_logger_factories = dict(stat_loggers or {})
        self._log_stats = log_stats
        self._log_stats_interval = log_stats_interval
        self.stat_loggers = StatLoggerSet(())
        self.info: EngineInfo | None = None
        self._streams: dict[str, RequestStream] = {}
        self._tracker = IterationStatsTracker()
        self._tasks: list[asyncio.Task[None]] = []
        self._dead: EngineDeadError | None = None
        self._shutting_down = False
        self._shut_down = asyncio.Event()
        self._died = asyncio.Event()  # EngineCore died on its own (not by shutdown())
        self.served_model_name = served_model_name or self.model_name

    @classmethod
    async def create(cls, config: EngineConfig, **kwargs: object) -> AsyncLLM:
        """Build and :meth:`start` an engine (keyword arguments as for the constructor)."""
        engine = cls(config, **kwargs)  # type: ignore[arg-type]
        await engine.start()
        return engine

    # -- properties ------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The model's display name."""
        return self.setup.source.display_name

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output."""
        return self.setup.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (with the ``--chat-template`` override, if any)."""
        return self._tokenizer

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine can no longer serve, or None while it can."""
        return self._dead or self.client.dead_error

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start EngineCore, the output handler, the stat loggers and their periodic log.

        Raises:
            EngineDeadError: EngineCore failed to start.
            PluginError: an ``engine.stat_loggers`` plugin failed to load or construct.
        """
        # Import stat-logger plugins first: a broken one stops start-up before weights load.
        plugin_classes = self.setup.catalog.load_group(STAT_LOGGERS)
        self.info = await self.client.start()
        # EngineCore's scheduler, policy and connector: their extra_args keys.
        self.input_processor.extra_args.take(self.info.extra_args_keys)
        try:
            self.stat_loggers = make_stat_loggers(
                self.setup, self.info, plugin_classes=plugin_classes,
                factories=self._stat_logger_factories, log_stats=self._log_stats,
                model_name=self.served_model_name)
        except BaseException:
            await self.client.shutdown()
            raise
        self._tasks.append(asyncio.create_task(self._handle_outputs(), name="output-handler"))
        if self._log_stats_interval > 0:
            self._tasks.append(asyncio.create_task(self._log_periodically(), name="stat-log"))
        self.stat_loggers.log_engine_initialized()

    def add_stat_logger(self, name: str, factory: StatLoggerFactory) -> None:
        """Add a stat logger, built with its context at :meth:`start` (now if started)."""
        if self.info is None:
            self._stat_logger_factories[name] = factory
        else:
            self.stat_loggers.loggers[name] = factory(
                stat_logger_context(self.setup, self.info, name,
                                    model_name=self.served_model_name))

    async def shutdown(self, reason: str = "the engine was shut down") -> None:
        """Stop EngineCore; requests in flight end at once with ``EngineDeadError(reason)``.

        Idempotent: a later (or concurrent) call waits until the first one is done. Then
        every stat logger's ``shutdown()`` is called, once (after its last ``record``), so
        it can flush what it buffered.
        """
        if self._shutting_down:
            await self._shut_down.wait()
            return
        self._shutting_down = True
        # First, so their clients are answered while EngineCore stops.
        self._fail_all(self._dead or EngineDeadError(reason))
        try:
            await self.client.shutdown()
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._fail_all(self._dead or EngineDeadError(reason))
        finally:
            self.tokenizer_pool.shutdown()
            self.stat_loggers.shutdown()
            self._shut_down.set()

    async def wait_for_death(self) -> EngineDeadError:
        """Wait until EngineCore dies on its own (never returns after :meth:`shutdown`).

        Returns:
            Why it died (the error every request gets from then on).
        """
        await self._died.wait()
        return self._dead or EngineDeadError("EngineCore died")

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, *,
        priority: int = 0, arrival_time: float | None = None,
    ) -> RequestStream:
        """Validate, tokenize and queue a request; returns the stream of its outputs.

        Tokenization runs on the caller's thread; :meth:`add_request_async` runs it on the
        tokenizer pool instead.

        Raises:
            ValidationError: the prompt or the params are invalid (nothing was queued).
            EngineDeadError: EngineCore is gone.
        """
        arrival = self._admit(request_id, priority, arrival_time)
        processed = self.input_processor.process(request_id, prompt, params, priority=priority,
                                                 arrival_time=arrival)
        return self._enqueue(processed, arrival)

    async def add_request_async(
        self, request_id: str, prompt: PromptType, params: SamplingParams, *,
        priority: int = 0, arrival_time: float | None = None,
    ) -> RequestStream:
        """:meth:`add_request`, with validation and tokenization on the tokenizer pool.

        The event loop stays free meanwhile: other requests and ``/health`` are served
        while a long prompt is tokenized.

        Raises:
            ValidationError: the prompt or the params are invalid (nothing was queued).
            EngineDeadError: EngineCore is gone (before or while the prompt was tokenized).
        """
        arrival = self._admit(request_id, priority, arrival_time)
        processed = await self.tokenizer_pool.run(
            self.input_processor.process, request_id, prompt, params, priority=priority,
            arrival_time=arrival)
        return self._enqueue(processed, arrival)

    def _admit(self, request_id: str, priority: int, arrival_time: float | None) -> float:
        """Checks made before tokenizing; returns the arrival time."""
        self._check_alive()
        self._check_new_id(request_id)
        if priority != 0 and self.config.scheduling_policy == "fcfs":
            raise ValidationError(f"priority {priority} has no effect under the fcfs "
                                  f"scheduling policy; start the engine with "
                                  f"--scheduling-policy priority", param="priority")
        return time.time() if arrival_time is None else arrival_time

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._streams:
            raise ValidationError(f"request id {request_id!r} is already in flight",
                                  param="request_id")

    def _enqueue(self, processed: ProcessedRequest, arrival: float) -> RequestStream:
        # Checked again: the engine may have died, or the id been taken, while tokenizing.
        self._check_alive()
        request_id = processed.request_id
        self._check_new_id(request_id)
        output = self.output_processor.add_request(processed)
        stream = RequestStream(output, on_close=self.abort)
        self._streams[request_id] = stream
        choice_ids = [child.request_id for child in processed.children]
        self._tracker.add_request(request_id, choice_ids, len(processed.prompt_token_ids),
                                  arrival)
        try:
            self.client.add_requests(processed.children)
        except BaseException:
            self._streams.pop(request_id, None)
            self.output_processor.abort_request(request_id)
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams, *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Run one request; yields its (cumulative) output after each step that changed it.

        The last output has ``finished=True``. Closing or cancelling the iteration (a client
        disconnect) aborts the request in EngineCore, which frees its KV blocks.

        Raises:
            ValidationError: before any output, when the request is invalid.
            EngineDeadError: EngineCore died (before or during the request).
        """
        stream = await self.add_request_async(request_id, prompt, params, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """End a request (all its choices) now; unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        choice_ids = self.output_processor.abort_request(request_id)
        now = time.time()
        self._tracker.finish(stream.output, now, reason="abort")
        self.stat_loggers.record(None, self._tracker.take(now))
        if choice_ids and self.dead_error is None:
            self.client.abort_requests(choice_ids)
        stream.notify()

    # -- engine state ----------------------------------------------------------------------

    async def is_healthy(self) -> bool:
        """True while EngineCore steps and the output handler runs."""
        if self.dead_error is not None or not self._tasks or self._tasks[0].done():
            return False
        return await self.client.is_healthy()

    async def get_stats(self) -> SchedulerStats:
        """EngineCore's current scheduler stats (also handed to the stat loggers).

        Raises:
            EngineDeadError: EngineCore is gone.
        """
        self._check_alive()
        stats = await self.client.get_stats()
        self.stat_loggers.record(stats, None)
        return stats

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks nobody uses; False if some are in use."""
        self._check_alive()
        return await self.client.reset_prefix_cache()

    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: dict[str, Any] | None = None,
                             timeout: float | None = None) -> list[Any]:
        """Call worker-extension ``method`` on every worker; one result per rank, in order.

        The call runs between two engine steps. Arguments and results must be
        JSON-serialisable when EngineCore or the workers run in other processes.

        Raises:
            CollectiveRpcError: no selected extension defines ``method``, it raised on a
                rank (the message names the rank, the extension and its distribution), or
                no answer came within ``timeout`` seconds. The engine keeps serving.
            EngineDeadError: the engine is gone.
        """
        self._check_alive()
        return await self.client.collective_rpc(method, tuple(args), kwargs, timeout)

    def _check_alive(self) -> None:
        error = self.dead_error
        if error is not None:
            raise error
        if self._shutting_down:
            raise EngineDeadError("the engine is shutting down")

    # -- output handling -------------------------------------------------------------------

    async def _handle_outputs(self) -> None:
        try:
            async for step in self.client.outputs():
                self._process_step(step)
            error = self.client.dead_error or EngineDeadError("EngineCore stopped")
        except EngineDeadError as exc:
            error = exc
        except Exception as exc:
            logger.exception("the output handler failed")
            error = EngineDeadError(f"the front end's output handler failed: "
                                    f"{type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self._dead = error
        self._fail_all(error)
        if not self._shutting_down:
            logger.error("engine is dead: %s", error)
            self.stat_loggers.mark_engine_dead(error)  # no stale figures in metrics and logs
            self._died.set()

    def _process_step(self, step: StepOutputs) -> None:
        now = step.timestamp or time.time()
        processed = self.output_processor.process_outputs(step.outputs)
        if processed.reqs_to_abort:
            self.client.finish_requests(processed.reqs_to_abort,
                                        RequestStatus.FINISHED_STOPPED)
        self._tracker.on_outputs(step.outputs, now)
        for output in processed.request_outputs:
            if output.finished:
                self._tracker.finish(output, now)
                stream = self._streams.pop(output.request_id, None)
            else:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.notify()
        self.stat_loggers.record(step.scheduler_stats, self._tracker.take(now))

    def _fail_all(self, error: EngineDeadError) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.fail(error)  # before abort_request marks the output finished
            self.output_processor.abort_request(request_id)

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._log_stats_interval)
            self.stat_loggers.log()
