"""``LLMEngine``: the synchronous front end, driven step by step.

It validates and tokenizes requests (``InputProcessor``), feeds EngineCore, and turns its
outputs into ``RequestOutput``s (``OutputProcessor``). ``LLM`` drives it to completion;
the server drives the same pieces asynchronously (``AsyncLLM``).

EngineCore runs in its own spawned process behind gRPC (the default, as under
``engine serve``: the front end's tokenization and detokenization overlap the model's
steps), or with ``in_process=True`` in this process with direct calls, where tests and
debuggers reach every seam (``engine.core.worker.built.model``, exceptions in the caller).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

from engine.core.client.sync_client import SyncCoreClient
from engine.core.config import EngineConfig
from engine.core.frontend.front_end import FrontEndParts
from engine.core.frontend.input_processor import ProcessedRequest, PromptType
from engine.core.outputs import RequestOutput
from engine.core.rpc.launch import EngineLaunch
from engine.core.startup import EngineSetup, prepare
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import RequestStatus

if TYPE_CHECKING:
    from engine.core.engine.engine_core import EngineCore

#: EngineCore as ``LLMEngine`` uses it: in this process, or a spawned one behind gRPC.
CoreHandle = Union["EngineCore", SyncCoreClient]


class LLMEngine:
    """Synchronous engine: ``add_request`` then ``step()`` until nothing is unfinished.

    Args:
        config: The engine's options.
        setup: A setup already made by ``prepare(config)`` (default: made here).
        in_process: Run EngineCore in this process (direct calls) instead of its own.

    Raises:
        EngineDeadError: EngineCore's process failed to start (with its error).
        ValidationError: a plugin class given as an object cannot be imported by
            EngineCore's process (use ``in_process=True``).
    """

    def __init__(self, config: EngineConfig, *, setup: EngineSetup | None = None,
                 in_process: bool = False) -> None:
        self.config = config
        self.in_process = in_process
        # EngineCore's process starts first: its imports and config reading overlap ours.
        launch = None if in_process else EngineLaunch.spawn(config)
        try:
            self.setup = setup or prepare(config)
            parts = FrontEndParts.build(config, self.setup)
            self.tokenizer, self.eos_token_id = parts.tokenizer, parts.eos_token_id
            self.input_processor = parts.input_processor
            self.output_processor = parts.output_processor
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
        # Stop EngineCore when the engine is garbage-collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, self.core.shutdown)

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
        return outputs

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    *, priority: int = 0) -> RequestOutput:
        """Validate, tokenize and queue one request; returns its live output object."""
        return self.add_processed_request(
            self.process_request(request_id, prompt, params, priority=priority))

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its choices); its KV blocks are freed."""
        self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        """True while a request is in flight."""
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests whose output changed."""
        outputs = self.core.step()
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            self.core.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return processed.request_outputs

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call a worker-extension method on every worker; one result per rank (in order).

        Raises:
            CollectiveRpcError: unknown method, an exception on a rank, or the timeout.
        """
        return self.core.collective_rpc(method, args, kwargs, timeout)

    def shutdown(self) -> None:
        """Stop the engine (and EngineCore's process); idempotent."""
        self._finalizer()
