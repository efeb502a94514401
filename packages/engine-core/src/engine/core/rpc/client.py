"""``GrpcCoreClient``: EngineCore in its own (spawned) process, reached over gRPC.

::

    front end (asyncio)                          EngineCore process (spawned)
    add/abort/finish -> outgoing queue ==Stream==> reader thread -> inbox -> busy loop
    outputs()        <- outputs queue  <==Stream== one ServerMessage per engine step
    process sentinel (add_reader) -> dead within milliseconds of the process exiting

By default the channel is a unix socket in a fresh directory with mode 0700, removed on
shutdown. With ``engine_address="host:port"`` EngineCore listens on TCP and every call
carries a per-launch secret (``secrets.token_urlsafe``) that the server checks.
:meth:`GrpcCoreClient.connect` reaches an EngineCore someone else started.

``add_requests``, ``abort_requests`` and ``finish_requests`` never block: they put a
message on the stream's outgoing queue. Call them from the event loop's thread (other
threads are handed over with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import AsyncIterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import grpc
import grpc.aio

from engine.core.client.core_client import EngineCoreClient
from engine.core.config import EngineConfig
from engine.core.messages import CollectiveRpcError, EngineDeadError, EngineInfo, StepOutputs
from engine.core.plugins import PluginManifest
from engine.core.rpc import convert
from engine.core.rpc._gen import engine_core_pb2 as pb
from engine.core.rpc._gen import engine_core_pb2_grpc as pb_grpc
from engine.core.rpc.channel import CHANNEL_OPTIONS, SECRET_METADATA_KEY, TCP_KEEPALIVE_OPTIONS
from engine.core.rpc.launch import EngineLaunch, describe_exit, join_process
from engine.core.startup import EngineSetup
from engine.sdk.scheduler import EngineRequest, RequestStatus
from engine.sdk.stats import SchedulerStats

logger = logging.getLogger("engine.core.rpc")

_END = object()  # ends outputs() after an orderly shutdown


class GrpcCoreClient(EngineCoreClient):
    """EngineCore in a spawned process, over ``proto/engine/v1/engine_core.proto``.

    Args:
        config: The engine configuration (sent to the process as JSON).
        manifest: The front end's resolved plugins; the process verifies it has the same.
        eos_token_id: The tokenizer's EOS id.
        engine_address: ``host:port`` to serve EngineCore on TCP (with a per-launch secret);
            None (default) for a private unix socket.
        startup_timeout: Seconds to wait for the process to load the model and listen.
        launch: A process already spawned for ``config`` by :meth:`EngineLaunch.spawn`
            (started early, so its start-up overlaps the front end's); this client takes
            it over. Default: spawn one in :meth:`start`.
    """

    def __init__(self, config: EngineConfig, manifest: PluginManifest, *,
                 eos_token_id: int | None, engine_address: str | None = None,
                 startup_timeout: float = 600.0, launch: EngineLaunch | None = None) -> None:
        self._init_state()
        self._config, self._manifest, self._eos_token_id = config, manifest, eos_token_id
        self._engine_address = engine_address
        self._startup_timeout = startup_timeout
        self._launch = launch
        self._spawn = True

    @classmethod
    def factory(cls, setup: EngineSetup, eos_token_id: int | None, *,
                engine_address: str | None = None, startup_timeout: float = 600.0,
                launch: EngineLaunch | None = None) -> GrpcCoreClient:
        """A client for ``setup`` (``AsyncLLM(config, client=GrpcCoreClient.factory)``).

        Bind the keywords with ``functools.partial`` for TCP, another timeout, or a process
        spawned early (``launch``).
        """
        return cls(setup.config, setup.manifest, eos_token_id=eos_token_id,
                   engine_address=engine_address, startup_timeout=startup_timeout,
                   launch=launch)

    @classmethod
    def connect(cls, address: str, *, secret: str | None = None) -> GrpcCoreClient:
        """A client of a running EngineCore at ``address`` (``unix:PATH`` or ``host:port``)."""
        client = cls.__new__(cls)
        client._init_state()
        client._address, client._secret, client._spawn = address, secret, False
        return client

    def _init_state(self) -> None:
        self._address: str | None = None
        self._secret: str | None = None
        self._socket_dir: str | None = None
        self._process: BaseProcess | None = None
        self._launch = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.EngineCoreStub | None = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._outgoing: asyncio.Queue[pb.ClientMessage | None] = asyncio.Queue()
        self._outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._process_exited = asyncio.Event()
        self._dead: EngineDeadError | None = None
        self._closing = False

    # --- properties ---------------------------------------------------------------------

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def address(self) -> str | None:
        """Where EngineCore listens (``unix:PATH`` or ``host:port``), once started."""
        return self._address

    @property
    def secret(self) -> str | None:
        """The per-launch secret (TCP), for other clients of the same EngineCore."""
        return self._secret

    @property
    def pid(self) -> int | None:
        """The EngineCore process id (None when connected to an existing one)."""
        return None if self._process is None else self._process.pid

    @property
    def socket_dir(self) -> str | None:
        """The per-launch unix socket directory, until shutdown removes it."""
        return self._socket_dir

    # --- start --------------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        if self._loop is not None:
            raise RuntimeError("GrpcCoreClient.start() was already called")
        self._loop = asyncio.get_running_loop()
        try:
            if self._spawn:
                await self._spawn_process()
            self._open_channel()
            assert self._stub is not None
            info = convert.info_from_proto(await self._stub.GetInfo(
                pb.GetInfoRequest(), metadata=self._metadata, timeout=30.0))
        except BaseException as exc:
            error = exc
            if isinstance(exc, grpc.aio.AioRpcError):
                error = EngineDeadError(f"cannot reach EngineCore at {self._address}: "
                                        f"{exc.code().name}: {exc.details()}")
            if isinstance(error, EngineDeadError):
                self._dead = error
            await self.shutdown()
            if error is exc:
                raise
            raise error from exc
        self._call = self._stub.Stream(self._requests(), metadata=self._metadata)
        self._reader = asyncio.create_task(self._read_stream(), name="engine-core-outputs")
        return info

    async def _spawn_process(self) -> None:
        launch = self._launch or EngineLaunch.spawn(self._config,
                                                   engine_address=self._engine_address)
        self._launch = launch
        self._process, self._secret, self._socket_dir = (launch.process, launch.secret,
                                                         launch.socket_dir)
        launch.send_settings(self._manifest, self._eos_token_id)
        self._address = await launch.wait_ready(self._startup_timeout)
        assert self._loop is not None
        self._loop.add_reader(launch.process.sentinel, self._on_process_exit)

    def _open_channel(self) -> None:
        assert self._address is not None
        options = list(CHANNEL_OPTIONS)
        if not self._address.startswith("unix:"):
            options += TCP_KEEPALIVE_OPTIONS
        self._channel = grpc.aio.insecure_channel(self._address, options=options)
        self._stub = pb_grpc.EngineCoreStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = ((SECRET_METADATA_KEY, self._secret),) if self._secret else None

    # --- the stream ---------------------------------------------------------------------

    async def _requests(self) -> AsyncIterator[pb.ClientMessage]:
        while True:
            message = await self._outgoing.get()
            if message is None:
                return
            yield message

    async def _read_stream(self) -> None:
        try:
            async for message in self._call:
                if message.HasField("step"):
                    self._outputs.put_nowait(convert.step_outputs_from_proto(message.step))
                elif message.HasField("error"):
                    self._mark_dead(message.error.message)
                    return
            reason = "EngineCore closed the stream"
        except grpc.aio.AioRpcError as exc:
            reason = f"the EngineCore stream failed: {exc.code().name}: {exc.details()}"
        process = self._process
        if process is not None and not self._closing:
            # The process is probably exiting: prefer its exit status as the reason.
            for _ in range(50):
                if process.exitcode is not None:
                    self._on_process_exit()
                    break
                await asyncio.sleep(0.01)
        self._mark_dead(reason)

    def _on_process_exit(self) -> None:
        process = self._process
        assert process is not None and self._loop is not None
        if self._process_exited.is_set():
            return
        self._loop.remove_reader(process.sentinel)
        # Reap it (no zombie). Its pipes close a moment before it can be waited for, so
        # allow that moment; in practice this returns within a millisecond.
        process.join(0.1)
        self._process_exited.set()
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._mark_dead(f"the EngineCore process (pid {process.pid}) ended: "
                        f"{describe_exit(process.exitcode)}")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None or self._closing:
            return
        logger.error("EngineCore is dead: %s", reason)
        self._dead = EngineDeadError(reason)
        self._outputs.put_nowait(self._dead)

    def _send(self, message: pb.ClientMessage) -> None:
        if self._loop is None:
            raise RuntimeError("GrpcCoreClient.start() has not been called")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._outgoing.put_nowait(message)
        else:
            self._loop.call_soon_threadsafe(self._outgoing.put_nowait, message)

    # --- EngineCoreClient ---------------------------------------------------------------

    def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closing:
            raise EngineDeadError("EngineCore is shutting down")
        self._send(pb.ClientMessage(add=pb.AddRequests(
            requests=[convert.request_to_proto(r) for r in requests])))

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        if self._dead is None and request_ids:
            self._send(pb.ClientMessage(abort=pb.AbortRequests(request_ids=request_ids)))

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> None:
        if self._dead is None and request_ids:
            self._send(pb.ClientMessage(finish=pb.FinishRequests(
                request_ids=request_ids, status=convert.request_status_to_proto(status))))

    async def outputs(self) -> AsyncIterator[StepOutputs]:
        while True:
            item = await self._outputs.get()
            if isinstance(item, EngineDeadError):
                self._outputs.put_nowait(item)  # later readers see the same end
                raise item
            if item is _END:
                self._outputs.put_nowait(item)
                return
            yield item

    async def is_healthy(self) -> bool:
        if self._dead is not None or self._stub is None:
            return False
        try:
            response = await self._stub.Health(pb.HealthRequest(), metadata=self._metadata,
                                               timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        return bool(response.healthy) and self._dead is None

    async def get_stats(self) -> SchedulerStats:
        response = await self._unary("GetStats", pb.GetStatsRequest())
        return convert.stats_from_proto(response)

    async def reset_prefix_cache(self) -> bool:
        response = await self._unary("ResetPrefixCache", pb.ResetPrefixCacheRequest())
        return bool(response.ok)

    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: dict[str, Any] | None = None,
                             timeout: float | None = None) -> list[Any]:
        try:
            call = pb.CollectiveRpcCall(method=method, args_json=json.dumps(list(args)),
                                        kwargs_json=json.dumps(kwargs or {}))
        except (TypeError, ValueError) as exc:
            raise CollectiveRpcError(
                f"collective_rpc {method!r}: arguments must be JSON-serialisable to reach "
                f"EngineCore's process ({exc})", method=method) from None
        if timeout is not None:
            call.timeout_s = timeout
        # The call waits for the step in progress, then for every rank.
        deadline = None if timeout is None else timeout + 60.0
        response = await self._unary("CollectiveRpc", call, timeout=deadline)
        if response.WhichOneof("kind") == "error":
            error = response.error
            raise CollectiveRpcError(error.message, method=method,
                                     rank=error.rank if error.HasField("rank") else None)
        results: list[Any] = json.loads(response.results_json)
        return results

    async def _unary(self, name: str, request: Any, *, timeout: float | None = 60.0) -> Any:
        if self._dead is not None:
            raise self._dead
        if self._stub is None:
            raise RuntimeError("GrpcCoreClient.start() has not been called")
        try:
            return await getattr(self._stub, name)(request, metadata=self._metadata,
                                                   timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if self._dead is not None:
                raise self._dead from exc
            raise EngineDeadError(f"EngineCore {name} failed: {exc.code().name}: "
                                  f"{exc.details()}") from exc

    async def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._outgoing.put_nowait(None)  # half-close the stream: the server can end it
        asked = False
        if self._stub is not None and self._dead is None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.Shutdown(pb.ShutdownRequest(), metadata=self._metadata,
                                          timeout=5.0)
                asked = True
        if self._process is not None:
            await self._stop_process(self._process, grace=10.0 if asked else 0.5)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._reader
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            await self._channel.close()
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._launch is not None:
            self._launch.detach()
        if self._dead is None:
            self._dead = EngineDeadError("EngineCore was shut down")
        self._outputs.put_nowait(_END)

    async def _stop_process(self, process: BaseProcess, grace: float) -> None:
        """Wait ``grace`` s for a clean exit, then SIGTERM, then SIGKILL; always reaped."""
        if self._loop is not None:
            self._loop.remove_reader(process.sentinel)
        await join_process(process, grace)
        for stop, wait in ((process.terminate, 5.0), (process.kill, None)):
            if not process.is_alive():
                break
            logger.warning("EngineCore did not exit; sending %s", stop.__name__)
            stop()
            await join_process(process, wait)
