"""The default scheduler's side of a KV connector: its calls, async loads, delayed frees.

``KVConnectorBridge`` is the only place the default scheduler calls the connector's
scheduler side (``engine.sdk.KVConnectorScheduler``). It checks what the connector returns
and turns an exception into a ``PluginError`` naming the connector (group
``engine.kv_connectors``, its distribution), and it keeps the two kinds of requests a
connector adds to the scheduler's life cycle::

    waiting --admit, load_async--> loading --worker: finished_recving--> waiting (holds
       |                            |                                    its blocks; runs
       |                            +--abort--> finished, blocks held until finished_recving
       +--admit, sync load--> running --finish--> request_finished(r, blocks)
                                                  -> (False, _): blocks freed now
                                                  -> (True, _): held until finished_sending

A loading request holds its blocks but is neither running nor in the waiting queue; its
blocks are left out of the prefix cache until the load is reported (another request must
not read KV that has not arrived). A finished request whose blocks are held is no longer
a request of the scheduler (its id is reported finished to the workers at once), but its
blocks stay allocated until every reason to hold them is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from engine.core.plugin_faults import call_plugin
from engine.core.scheduler.request import Request
from engine.sdk.errors import PluginError
from engine.sdk.groups import KV_CONNECTORS
from engine.sdk.kv_connector import KVConnectorMetadata, KVConnectorScheduler
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput
from engine.sdk.stats import PrefixCacheStats

logger = logging.getLogger("engine.kv_connector")

T = TypeVar("T")


def kv_connector_error(plugin_name: str, cause: str) -> PluginError:
    """A ``PluginError`` naming the KV connector selected as ``plugin_name`` and its source."""
    from engine.core.plugins import get_catalog

    try:
        return get_catalog().error(KV_CONNECTORS, plugin_name, cause)
    except Exception:  # noqa: BLE001 - no catalog to ask: name what we know
        return PluginError(cause, plugin=plugin_name or None, group=KV_CONNECTORS)


@dataclass
class _HeldBlocks:
    """A finished request whose blocks stay allocated until the workers report it."""

    request: Request
    waits_for_recv: bool  # aborted while its asynchronous load was in flight
    waits_for_send: bool  # request_finished returned True


@dataclass(frozen=True)
class TransferResults:
    """What one step's ``finished_sending`` / ``finished_recving`` changed.

    Attributes:
        loaded: Requests whose asynchronous load completed: schedulable again.
        released: Finished requests whose blocks may be freed now.
    """

    loaded: tuple[Request, ...] = ()
    released: tuple[Request, ...] = ()


class KVConnectorBridge:
    """The scheduler side of the selected connector, as the default scheduler uses it.

    Args:
        connector: The connector's scheduler side (``SchedulerContext.kv_connector``).
    """

    def __init__(self, connector: KVConnectorScheduler) -> None:
        self.connector = connector
        self.name = getattr(getattr(connector, "ctx", None), "plugin_name", "") or type(
            connector).__qualname__
        #: Requests whose asynchronous load is in flight, with the tokens computed after it.
        self.loading: dict[str, tuple[Request, int]] = {}
        self._held: dict[str, _HeldBlocks] = {}
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0

    def _call(self, hook: str, fn: Callable[..., T], *args: object) -> T:
        return call_plugin(hook, fn, *args,
                           error=lambda cause: kv_connector_error(self.name, cause))

    @property
    def num_held(self) -> int:
        """Finished requests whose blocks are still held for the workers."""
        return len(self._held)

    def is_held(self, request_id: str) -> bool:
        """True while a finished request of this id still holds blocks."""
        return request_id in self._held

    # -- admission -------------------------------------------------------------------

    def match(self, request: Request, num_local_tokens: int) -> tuple[int, bool]:
        """External tokens to take beyond the local hits, and whether they load async.

        The connector's offer is cut so the last token is always computed here.

        Raises:
            PluginError: the connector raised or returned something else than
                ``(int >= 0, bool)``.
        """
        result = self._call("get_num_new_matched_tokens",
                            self.connector.get_num_new_matched_tokens, request,
                            num_local_tokens)
        if (not isinstance(result, tuple) or len(result) != 2
                or isinstance(result[0], bool) or not isinstance(result[0], int)
                or result[0] < 0):
            raise kv_connector_error(
                self.name, f"get_num_new_matched_tokens returned {result!r}; it must return "
                           f"(num_tokens: int >= 0, load_async: bool)")
        num_offered, load_async = result
        num_external = max(0, min(num_offered, request.num_tokens - 1 - num_local_tokens))
        return num_external, bool(load_async) and num_external > 0

    def after_alloc(self, request: Request, block_ids: Sequence[int],
                    num_external_tokens: int) -> None:
        """``update_state_after_alloc``; ``request.num_computed_tokens`` is the local hits.

        Called once per admission the connector was asked about, so that admission's
        lookup is counted here (:meth:`make_prefix_cache_stats`) once the connector
        accepted it: the tokens past the local hits were queried, ``num_external_tokens``
        of them hit.
        """
        self._call("update_state_after_alloc", self.connector.update_state_after_alloc,
                   request, tuple(block_ids), num_external_tokens)
        self._num_queried_tokens += request.num_tokens - request.num_computed_tokens
        self._num_hit_tokens += num_external_tokens

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The connector's lookups since the previous call (``connector_prefix_cache``)."""
        stats = PrefixCacheStats(queries=self._num_queried_tokens, hits=self._num_hit_tokens)
        self._num_queried_tokens = self._num_hit_tokens = 0
        return stats

    def start_loading(self, request: Request, num_computed_after: int) -> None:
        """Park ``request`` until a worker reports its asynchronous load."""
        self.loading[request.request_id] = (request, num_computed_after)

    # -- each step -------------------------------------------------------------------

    def build_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        """``build_connector_meta`` serialised with ``to_bytes`` for the workers."""
        meta = self._call("build_connector_meta", self.connector.build_connector_meta,
                          scheduler_output)
        if not isinstance(meta, KVConnectorMetadata):
            raise kv_connector_error(
                self.name, f"build_connector_meta returned {type(meta).__qualname__}, not a "
                           f"KVConnectorMetadata (its KVConnector.metadata_cls)")
        data = self._call("to_bytes", meta.to_bytes)
        if not isinstance(data, bytes):
            raise kv_connector_error(
                self.name, f"{type(meta).__qualname__}.to_bytes returned "
                           f"{type(data).__qualname__}, not bytes")
        return data

    def on_transfers(self, runner_output: ModelRunnerOutput) -> TransferResults:
        """Apply the workers' ``finished_recving`` and ``finished_sending`` of one step.

        Ids the scheduler is not waiting for are ignored (logged at debug level).
        """
        loaded: list[Request] = []
        released: list[Request] = []
        for request_id in runner_output.finished_recving:
            entry = self.loading.pop(request_id, None)
            if entry is not None:
                request, num_computed = entry
                request.num_computed_tokens = num_computed
                loaded.append(request)
                continue
            held = self._held.get(request_id)
            if held is None or not held.waits_for_recv:
                logger.debug("%s reported load of %r, which is not loading", self.name,
                             request_id)
                continue
            held.waits_for_recv = False
            self._release_if_done(request_id, released)
        for request_id in runner_output.finished_sending:
            held = self._held.get(request_id)
            if held is None or not held.waits_for_send:
                logger.debug("%s reported send of %r, whose blocks are not held", self.name,
                             request_id)
                continue
            held.waits_for_send = False
            self._release_if_done(request_id, released)
        return TransferResults(tuple(loaded), tuple(released))

    def _release_if_done(self, request_id: str, released: list[Request]) -> None:
        held = self._held[request_id]
        if not (held.waits_for_recv or held.waits_for_send):
            del self._held[request_id]
            released.append(held.request)

    # -- the end of a request --------------------------------------------------------

    def finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        """``request_finished``; True when the request's blocks must be held (not freed).

        A request aborted while its asynchronous load is in flight keeps its blocks until
        the load is reported (the worker is still writing them), whatever the connector
        answers. A ``request_finished`` that raises is logged (naming the connector) and
        answered as ``(False, None)``: the request ends as it would have.
        """
        request_id = request.request_id
        was_loading = self.loading.pop(request_id, None) is not None
        try:
            result = self._call("request_finished", self.connector.request_finished, request,
                                tuple(block_ids))
            if not isinstance(result, tuple) or len(result) != 2:
                raise kv_connector_error(
                    self.name, f"request_finished returned {result!r}; it must return "
                               f"(free_later: bool, kv_transfer_params: dict | None)")
        except PluginError as exc:
            # The request's own result stands (it had ended); its blocks are not held for
            # a save the connector can no longer be trusted with.
            logger.error("%s; request %s ends as it was, its blocks are freed now", exc,
                         request_id)
            result = (False, None)
        free_later, params = result
        if params is not None:
            logger.debug("%s: kv_transfer_params of %r: %r", self.name, request_id, params)
        waits_for_send = bool(free_later) and bool(block_ids)
        if not (was_loading or waits_for_send):
            return False
        self._held[request_id] = _HeldBlocks(request, was_loading, waits_for_send)
        return True
