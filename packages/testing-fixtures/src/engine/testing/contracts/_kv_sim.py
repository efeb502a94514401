"""Driving a KV connector's two sides through the engine's default scheduler and a fake worker.

:class:`KVConnectorDriver` is a :class:`SchedulerDriver` whose scheduler is the engine's
default ``Scheduler`` with the connector's scheduler side in its context, and whose worker
(:class:`FakeKVWorker`) holds real KV-cache tensors (one per layer, in the layout of the
engine's CPU attention backends ``cpu`` and ``torch``, from their ``get_kv_cache_shape``:
``(2, num_blocks, num_kv_heads, block_size, head_size)``, block index in dimension 1, a
token's keys of all heads at ``cache[0, block, :, offset]``) and runs the
connector's worker side exactly as a worker does: metadata from bytes, ``start_load_kv``,
per layer ``wait_for_layer_load`` -> the step's KV written -> every position the layer's
attention would read checked -> ``save_kv_layer``, then ``wait_for_save`` and
``get_finished``.

Every KV element is a function of the layer and the tokens up to its position, so a block
loaded into the wrong place, loaded too late (after its layer read it), saved from the
wrong block or never loaded fails the step with the position that is wrong.

.. versionadded:: 1.1
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sdk.kv_connector import (
    KVConnector,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from engine.sdk.plugin import PluginOptions
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerContext, SchedulerOutput
from engine.testing.contracts._scheduler_sim import SchedulerDriver, apply_deltas, sample_step

__all__ = ["FakeKVWorker", "KVConnectorDriver", "KVSimConfig", "kv_value"]

#: Residues of the rolling context hash (kept below 2**20 so values stay exact in float32).
_MODULUS = 1_000_003


def kv_value(context_hash: int, layer: int) -> float:
    """The KV value of a position whose context hashes to ``context_hash``, in ``layer``."""
    return float(context_hash + (layer + 1) * 1_048_576)


@dataclass(frozen=True)
class KVSimConfig:
    """The engine the conformance suite simulates.

    Attributes:
        block_size: Tokens per block.
        num_kv_blocks: Usable blocks (the caches hold one more: block 0).
        num_layers: Attention layers.
        num_kv_heads: Key/value heads per layer.
        head_size: Elements per head.
        max_num_seqs: Most requests per step.
        max_num_batched_tokens: The token budget.
        max_model_len: Longest sequence.
        enable_prefix_caching: The scheduler's own prefix cache.
    """

    block_size: int = 4
    num_kv_blocks: int = 64
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 4
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 64
    max_model_len: int = 64
    enable_prefix_caching: bool = True

    @property
    def layer_names(self) -> tuple[str, ...]:
        """``model.layers.{i}.self_attn.attn``, as the built-in models name them."""
        return tuple(f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers))

    def connector_context(self, cls: type[KVConnector], options: PluginOptions,
                          role: KVConnectorRole) -> KVConnectorContext:
        """The context EngineCore (scheduler side) or a worker gives a connector side."""
        worker = role is KVConnectorRole.WORKER
        return KVConnectorContext(
            plugin_name=cls.name or cls.__qualname__, options=options,
            process="worker" if worker else "engine_core", model="conformance-model",
            role=role, engine_id="conformance", block_size=self.block_size,
            num_blocks=self.num_kv_blocks + 1, num_layers=self.num_layers,
            layer_names=self.layer_names if worker else (), num_kv_heads=self.num_kv_heads,
            head_size=self.head_size, kv_cache_dtype="float32")

    def scheduler_context(self, connector: KVConnectorScheduler) -> SchedulerContext:
        """The default scheduler's context, with ``connector`` as its KV connector."""
        return SchedulerContext(
            plugin_name="default", process="engine_core", block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, kv_connector=connector)


def kv_cache_shape(config: KVSimConfig) -> tuple[int, ...]:
    """One layer's cache: the engine's CPU backend's shape (the null block 0 included).

    Raises:
        RuntimeError: the backend's layout is not the one the simulator indexes.
    """
    from engine.kernels.cpu.attention import CpuAttentionBackend

    num_blocks = config.num_kv_blocks + 1
    shape = tuple(CpuAttentionBackend.get_kv_cache_shape(
        num_blocks, config.block_size, config.num_kv_heads, config.head_size))
    layout = (2, num_blocks, config.num_kv_heads, config.block_size, config.head_size)
    if shape != layout:
        raise RuntimeError(
            f"the cpu attention backend's KV-cache shape is {shape}, the simulator indexes "
            f"{layout} (2, blocks, heads, block_size, head_size): update FakeKVWorker")
    return shape


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    hashes: list[int] = field(default_factory=list)  # rolling context hash per position

    def extend_hashes(self) -> None:
        acc = self.hashes[-1] if self.hashes else 0
        for position in range(len(self.hashes), len(self.token_ids)):
            acc = (acc * 31 + self.token_ids[position] * (position + 1)) % _MODULUS
            self.hashes.append(acc)


class FakeKVWorker:
    """A worker with real KV tensors that runs a connector's worker side every step.

    Args:
        config: The simulated engine.
        connector: The worker side under test (``register_kv_caches`` is called here).
        metadata_cls: ``KVConnector.metadata_cls``.

    Attributes:
        kv_caches: Layer name -> cache tensor.
        requests: The worker's view of each scheduled request.
        num_partial_chunks: Steps in which a prompt was only partly computed.
    """

    def __init__(self, config: KVSimConfig, connector: KVConnectorWorker,
                 metadata_cls: type[KVConnectorMetadata]) -> None:
        self.config = config
        self.connector = connector
        self.metadata_cls = metadata_cls
        shape = kv_cache_shape(config)
        self.kv_caches = {name: torch.full(shape, -1.0) for name in config.layer_names}
        # [1, 2, heads, head_size]: keys and values of each head and element differ.
        self._offsets = torch.arange(2 * config.num_kv_heads * config.head_size,
                                     dtype=torch.float32).view(1, 2, config.num_kv_heads,
                                                               config.head_size)
        self.requests: dict[str, _State] = {}
        self.num_partial_chunks = 0
        #: The metadata object the scheduler side built for the step (set by the driver).
        self.sent: Callable[[], KVConnectorMetadata | None] = lambda: None
        connector.register_kv_caches(dict(self.kv_caches))

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (see the module docstring); ``AssertionError`` names what broke."""
        apply_deltas(self.requests, out, lambda new: _State(
            [*new.prompt_token_ids, *new.output_token_ids], list(new.block_ids),
            new.num_computed_tokens))
        assert out.kv_connector_metadata is not None, (
            "the scheduler sent no kv_connector_metadata although a connector is set")
        metadata = self.metadata_cls.from_bytes(out.kv_connector_metadata)
        assert isinstance(metadata, self.metadata_cls)
        sent = self.sent()
        assert sent is None or metadata == sent, (
            f"{self.metadata_cls.__qualname__}: from_bytes(to_bytes(m)) != m; the two must be "
            f"inverse (built {sent!r}, the worker decoded {metadata!r})")
        self.connector.start_load_kv(metadata)
        for layer, name in enumerate(self.config.layer_names):
            self.connector.wait_for_layer_load(name)
            self._write_and_check(layer, name, out)
            self.connector.save_kv_layer(name, self.kv_caches[name], None)
        self.connector.wait_for_save()
        sending, recving = self.connector.get_finished(set(out.finished_req_ids))
        return self._sample(out, frozenset(sending), frozenset(recving))

    def _slots(self, state: _State, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.config.block_size
        positions = range(start, stop)
        blocks = torch.tensor([state.block_ids[p // size] for p in positions])
        assert bool((blocks != 0).all()), "block 0 is the null block: never in a block table"
        return blocks, torch.tensor([p % size for p in positions])

    def _values(self, state: _State, layer: int, start: int, stop: int) -> torch.Tensor:
        """``[tokens, 2, heads, head_size]``: what ``cache[:, blocks, :, offsets]`` holds."""
        state.extend_hashes()
        base = torch.tensor([kv_value(h, layer) for h in state.hashes[start:stop]])
        return base.view(-1, 1, 1, 1) + self._offsets

    def _write_and_check(self, layer: int, name: str, out: SchedulerOutput) -> None:
        cache = self.kv_caches[name]
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            assert end <= len(state.token_ids), f"{req_id} scheduled past its known tokens"
            blocks, offsets = self._slots(state, start, end)
            # The slice between the two index tensors puts the token dimension first.
            cache[:, blocks, :, offsets] = self._values(state, layer, start, end)
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            end = state.num_computed_tokens + num_tokens
            blocks, offsets = self._slots(state, 0, end)
            got = cache[:, blocks, :, offsets]
            want = self._values(state, layer, 0, end)
            wrong = (got != want).flatten(1).any(dim=1).nonzero().flatten().tolist()
            assert not wrong, (
                f"{req_id}: layer {name} reads wrong KV at positions {wrong[:8]} of {end} (a "
                f"block loaded into the wrong place, loaded after the layer needed it, not "
                f"loaded at all, or its tokens were reported computed but never were)")

    def _sample(self, out: SchedulerOutput, sending: frozenset[str],
                recving: frozenset[str]) -> ModelRunnerOutput:
        req_ids, sampled, num_partial = sample_step(self.requests, out,
                                                    lambda state: state.token_ids)
        self.num_partial_chunks += num_partial
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 finished_sending=sending, finished_recving=recving)


@dataclass
class _Spy:
    """What the connector's scheduler side answered and was told, per request id."""

    num_external_tokens: int = 0
    async_admissions: set[str] = field(default_factory=set)
    last_offer: dict[str, tuple[int, bool]] = field(default_factory=dict)
    last_meta: KVConnectorMetadata | None = None


def _spy_on(side: KVConnectorScheduler, spy: _Spy) -> None:
    """Record the scheduler side's answers and what ``update_state_after_alloc`` is told."""
    offer: Callable[..., tuple[int, bool]] = side.get_num_new_matched_tokens
    after_alloc: Callable[..., None] = side.update_state_after_alloc
    build: Callable[..., KVConnectorMetadata] = side.build_connector_meta

    def build_connector_meta(scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        spy.last_meta = build(scheduler_output)
        return spy.last_meta

    def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        result = offer(request, num_computed_tokens)
        spy.last_offer[request.request_id] = result
        return result

    def update_state_after_alloc(request: Any, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        spy.num_external_tokens += num_external_tokens
        if num_external_tokens and spy.last_offer.get(request.request_id, (0, False))[1]:
            spy.async_admissions.add(request.request_id)
        after_alloc(request, block_ids, num_external_tokens)

    side.get_num_new_matched_tokens = get_num_new_matched_tokens  # type: ignore[method-assign]
    side.update_state_after_alloc = update_state_after_alloc  # type: ignore[method-assign]
    side.build_connector_meta = build_connector_meta  # type: ignore[method-assign]


class KVConnectorDriver(SchedulerDriver):
    """One simulated engine: default scheduler + connector sides + :class:`FakeKVWorker`.

    Build it with :meth:`start`. ``spy`` records what the connector offered and supplied.
    """

    spy: _Spy
    scheduler_side: KVConnectorScheduler
    worker_side: KVConnectorWorker

    @classmethod
    def start(cls, connector: type[KVConnector], options: PluginOptions,
              config: KVSimConfig) -> KVConnectorDriver:
        """Build both sides of ``connector`` and the scheduler, as EngineCore does."""
        from engine.core.scheduler import Scheduler

        scheduler_side = connector.scheduler_cls(
            config.connector_context(connector, options, KVConnectorRole.SCHEDULER))
        worker_side = connector.worker_cls(
            config.connector_context(connector, options, KVConnectorRole.WORKER))
        spy = _Spy()
        _spy_on(scheduler_side, spy)
        driver = cls(Scheduler(config.scheduler_context(scheduler_side)))
        worker = FakeKVWorker(config, worker_side, connector.metadata_cls)
        worker.sent = lambda: spy.last_meta
        driver.worker = worker  # type: ignore[assignment]
        driver.spy, driver.scheduler_side, driver.worker_side = spy, scheduler_side, worker_side
        return driver

    def run(self, max_steps: int = 10_000,
            on_step: Callable[[int], None] | None = None) -> None:
        """Step until nothing is unfinished and no finished request holds blocks; check.

        After the first 100 steps each step also yields the GIL briefly, as a real engine's
        forward pass does, so a connector's background transfers can finish (on a busy
        machine a tight loop of empty steps could otherwise outrun them).
        """
        for index in range(max_steps):
            if not (self.scheduler.has_unfinished_requests()
                    or self.scheduler.has_finished_requests()):
                break
            if on_step is not None:
                on_step(index)
            self.step()
            if index >= 100:
                time.sleep(0.001)
        else:
            raise AssertionError(
                f"requests still unfinished (or their blocks held) after {max_steps} steps: "
                f"{sorted(self.live_ids)[:8]}; does get_finished report every asynchronous "
                f"load and delayed free?")
        self.step()  # an empty step: nothing may be pending after it
        self.assert_pool_full()
        assert self.worker.requests == {}, (
            f"the worker still holds {sorted(self.worker.requests)}")

    def shutdown(self) -> None:
        """Both sides' ``shutdown``."""
        self.scheduler_side.shutdown()
        self.worker_side.shutdown()
