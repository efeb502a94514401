"""``TokenizerPool``: tokenizer work (encode, chat templates) off the event loop.

A 20 MB prompt takes tens of seconds to tokenize; on the event loop that stalls every other
client, ``/health`` included. The pool runs such work on a few threads instead. The
``tokenizers`` library releases the GIL while it encodes, so the loop keeps answering;
concurrent ``encode`` calls on one fast tokenizer are safe (they only read it).

The threads are daemons: a shutdown does not wait for a long tokenization to finish (the
request it served has already failed), so the process can exit at once.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.core.cpu_threads import tokenizer_threads
from engine.core.messages import EngineDeadError

T = TypeVar("T")

_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return  # the caller gave up (client disconnect); drop the result
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class TokenizerPool:
    """A fixed set of daemon threads that run tokenizer calls for async callers.

    Args:
        num_threads: How many calls may run at once; default: one per CPU this process
            may use, within [2, 8] (``engine.core.cpu_threads.tokenizer_threads``).
        name: Thread name prefix (shown in stack dumps).
    """

    def __init__(self, num_threads: int | None = None, name: str = "tokenizer") -> None:
        if num_threads is None:
            num_threads = tokenizer_threads()
        if num_threads < 1:
            raise ValueError(f"a tokenizer pool needs at least 1 thread, got {num_threads}")
        self.num_threads = num_threads
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a pool thread; its result or exception.

        Raises:
            EngineDeadError: the pool was shut down (with its engine).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._start_threads()
        self._jobs.put((functools.partial(fn, *args, **kwargs), loop, future))
        return await future

    def shutdown(self) -> None:
        """Stop the threads once their current call ends; later :meth:`run` calls fail."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)

    def _start_threads(self) -> None:
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine was shut down (its tokenizer threads "
                                      "stopped)")
            while len(self._threads) < self.num_threads:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._name}-{len(self._threads)}")
                thread.start()
                self._threads.append(thread)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, loop, future = job
            if future.cancelled():
                continue
            result, error = None, None
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                error = exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                pass  # the loop is closed: nobody waits any more
