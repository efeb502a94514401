"""EngineCore's side of structured outputs: compiles, matchers, the step's bitmask.

``EngineCore`` hands every request with ``structured_outputs`` here first. Its grammar is
compiled on a worker thread (cached per spec), and the request reaches the scheduler only
once that is done, so a slow compile never stalls the requests already decoding. The
backend itself is built on the first such request (that loads the tokenizer in EngineCore);
an engine that never sees one never pays for it. Per step::

    bitmask = manager.grammar_bitmask(scheduler_output)     # rows of constrained requests
    ... the workers mask those rows' logits and sample ...
    failed, finished = manager.accept(outputs)              # advance each matcher

A backend that raises fails the requests it was serving, with an error naming it; a sampled
token the grammar refuses (only possible when something else forced it) fails that request.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.core.plugin_construction import construct_plugin
from engine.core.plugin_faults import call_plugin
from engine.core.startup import EngineSetup
from engine.sdk.errors import PluginError, PluginFailure, ValidationError
from engine.sdk.groups import STRUCTURED_OUTPUT_BACKENDS
from engine.sdk.plugin import PluginOptions
from engine.sdk.scheduler import EngineCoreOutput, EngineRequest, SchedulerOutput
from engine.sdk.structured_output import (
    GrammarBitmask,
    StructuredOutputBackend,
    StructuredOutputContext,
    StructuredOutputMatcher,
    StructuredOutputsParams,
)

logger = logging.getLogger("engine.structured_output")

#: Compiled grammars kept for reuse (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256


def load_backend_class(setup: EngineSetup) -> type[StructuredOutputBackend]:
    """The class ``--structured-outputs-backend`` selects (imported and checked).

    Raises:
        PluginError: unknown, fails to import, or not a ``StructuredOutputBackend``.
    """
    cls: type[StructuredOutputBackend] = setup.catalog.load(
        STRUCTURED_OUTPUT_BACKENDS, setup.config.structured_outputs_backend)
    return cls


def build_backend(setup: EngineSetup, cls: type[StructuredOutputBackend], *, process: str,
                  tokenizer: Any, eos_token_ids: Sequence[int]) -> StructuredOutputBackend:
    """Construct the selected backend for ``process`` (its options validated).

    Raises:
        PluginError: the options are invalid or the constructor raised.
    """
    name = setup.config.structured_outputs_backend

    def make(options: PluginOptions) -> StructuredOutputBackend:
        return cls(StructuredOutputContext(
            plugin_name=name, options=options, process=process,
            model=setup.source.display_name, tokenizer=tokenizer,
            vocab_size=setup.vocab_size, eos_token_ids=tuple(eos_token_ids)))

    return construct_plugin(setup, STRUCTURED_OUTPUT_BACKENDS, name, cls, make)


#: What a backend hook may raise unchanged: a spec the client got wrong, a named failure.
_PASSES = (ValidationError, PluginError)


def backend_error(setup: EngineSetup) -> Callable[[str], PluginError]:
    """``error(cause)``: a ``PluginError`` naming the selected backend and its distribution."""
    return functools.partial(setup.catalog.error, STRUCTURED_OUTPUT_BACKENDS,
                             setup.config.structured_outputs_backend)


def frontend_validator(setup: EngineSetup, tokenizer: Any, eos_token_ids: Sequence[int]
                       ) -> Callable[[StructuredOutputsParams], None]:
    """The front end's check of a request's spec: the selected backend's ``validate``.

    A ``ValidationError`` passes through (HTTP 400); anything else the backend raises is a
    ``PluginError`` naming it (that request fails, HTTP 500).

    Raises:
        PluginError: the backend cannot be loaded or constructed (at start-up).
    """
    backend = build_backend(setup, load_backend_class(setup), process="frontend",
                            tokenizer=tokenizer, eos_token_ids=eos_token_ids)
    error = backend_error(setup)

    def check(params: StructuredOutputsParams) -> None:
        call_plugin("validate", backend.validate, params, error=error, passes=_PASSES)

    return check


class StructuredOutputManager:
    """Structured outputs for one EngineCore (see the module docstring).

    Args:
        setup: The engine setup (the backend selection, the model's tokenizer).
        eos_token_ids: The ids that end generation (a finished grammar allows only these).
        tokenizer_loader: Returns the ``transformers`` tokenizer; called once, on the
            compile thread, when the first constrained request arrives.
    """

    def __init__(self, setup: EngineSetup, eos_token_ids: Sequence[int],
                 tokenizer_loader: Callable[[], Any]) -> None:
        self._setup = setup
        self._cls = load_backend_class(setup)  # a broken selection stops start-up
        construct_plugin(setup, STRUCTURED_OUTPUT_BACKENDS,  # and so do bad options
                         setup.config.structured_outputs_backend, self._cls, lambda o: o)
        self._eos = tuple(eos_token_ids)
        self._tokenizer_loader = tokenizer_loader
        self._backend: StructuredOutputBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._grammars: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._error = backend_error(setup)
        self._pending: dict[str, tuple[EngineRequest, Future[StructuredOutputMatcher]]] = {}
        self._matchers: dict[str, StructuredOutputMatcher] = {}
        self._words = math.ceil(setup.vocab_size / 32)

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> bool:
        """Start compiling ``request``'s grammar; False when it has no structured outputs."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix="engine-structured-output")
        self._pending[request.request_id] = (request, self._pool.submit(self._matcher, params))
        return True

    def _matcher(self, params: StructuredOutputsParams) -> StructuredOutputMatcher:
        """On the compile thread: the backend (built once), the grammar (cached), a matcher."""
        backend = self._get_backend()
        key = params.key
        if key in self._grammars:  # only this thread touches the cache
            self._grammars.move_to_end(key)
        else:  # a failed compile is not kept: the next request with the spec tries again
            self._grammars[key] = self._call("compile", backend.compile, params)
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        matcher: StructuredOutputMatcher = self._call("matcher", backend.matcher,
                                                      self._grammars[key])
        return matcher

    def _get_backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            self._backend = build_backend(self._setup, self._cls, process="engine_core",
                                          tokenizer=self._tokenizer_loader(),
                                          eos_token_ids=self._eos)
        return self._backend

    def has_pending(self) -> bool:
        """True while some request waits for its grammar."""
        return bool(self._pending)

    def wait_pending(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until some pending grammar is ready."""
        concurrent.futures.wait([f for _, f in self._pending.values()], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def ready(self) -> tuple[list[EngineRequest], list[EngineCoreOutput]]:
        """The requests whose grammar is ready, and the outputs of those that failed.

        Ready requests come in arrival order (for the scheduler); a failed compile gives the
        request's final output, with the error.
        """
        ready: list[EngineRequest] = []
        failed: list[EngineCoreOutput] = []
        for request_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            exc = future.exception()
            if exc is None:
                self._matchers[request_id] = future.result()
                ready.append(request)
                continue
            failure = self._failure(exc)
            logger.error("request %s: its structured output cannot be served: %s",
                         request_id, failure.message)
            failed.append(EngineCoreOutput(request_id=request_id, new_token_ids=(),
                                           finish_reason="error", error=failure))
        return ready, failed

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished or aborted requests (pending ones never reach the scheduler)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            entry = self._pending.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()

    # -- one step --------------------------------------------------------------------------

    def grammar_bitmask(self, out: SchedulerOutput) -> tuple[GrammarBitmask | None,
                                                             dict[str, PluginFailure]]:
        """The bitmask of the step's constrained requests, and those the backend failed.

        When ``fill_bitmask`` raises, no row is constrained this step and every constrained
        request of the step is returned as failed (the caller fails them after the step).
        """
        req_ids = tuple(r for r in out.num_scheduled_tokens if r in self._matchers)
        if not req_ids:
            return None, {}
        import torch

        bitmask = torch.zeros((len(req_ids), self._words), dtype=torch.int32)
        matchers = [self._matchers[r] for r in req_ids]
        backend = self._get_backend()
        try:
            self._call("fill_bitmask", backend.fill_bitmask, matchers, bitmask)
        except PluginError as exc:
            failure = PluginFailure.from_error(exc)
            return None, dict.fromkeys(req_ids, failure)
        return GrammarBitmask(req_ids, bitmask), {}

    def accept(self, outputs: Sequence[EngineCoreOutput]
               ) -> tuple[dict[str, PluginFailure], list[str]]:
        """Advance each constrained request past its new tokens.

        Returns:
            The requests to fail (the grammar refused a token, or the backend raised), and
            those whose grammar is complete though the request did not stop (they stop now).
        """
        failed: dict[str, PluginFailure] = {}
        complete: list[str] = []
        for output in outputs:
            matcher = self._matchers.get(output.request_id)
            if matcher is None or not output.new_token_ids:
                continue
            try:
                if not self._call("accept_tokens", matcher.accept_tokens,
                                  output.new_token_ids):
                    failed[output.request_id] = self._refused(output.new_token_ids)
                elif output.finish_reason is None and self._call(
                        "is_terminated", matcher.is_terminated):
                    complete.append(output.request_id)
            except PluginError as exc:
                failed[output.request_id] = PluginFailure.from_error(exc)
        return failed, complete

    def _refused(self, token_ids: Sequence[int]) -> PluginFailure:
        return PluginFailure.from_error(self._error(
            f"the grammar refused sampled token(s) {list(token_ids)} (another logits "
            f"processor, min_tokens or logit_bias forced a token the grammar does not allow)"))

    def _call(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; anything but a ``ValidationError`` becomes a ``PluginError``."""
        return call_plugin(hook, fn, *args, error=self._error, passes=_PASSES)

    def _failure(self, exc: BaseException) -> PluginFailure:
        if isinstance(exc, PluginError):
            return PluginFailure.from_error(exc)
        return PluginFailure.from_error(self._error(f"compile refused the spec: {exc}"))

    def shutdown(self) -> None:
        """Stop the compile thread and the backend."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            try:
                self._backend.shutdown()
            except Exception:
                logger.exception("structured-output backend %r: shutdown failed",
                                 self._setup.config.structured_outputs_backend)
