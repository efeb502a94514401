"""``engine.testing.contracts.check_kv_connector`` on ``offload``, and on broken connectors.

The suite must pass the built-in connector in each of its modes, and fail connectors that
break the contract in the ways plugin authors do: a block not loaded, a load never
reported, a block stored under the wrong key, metadata that does not survive the wire.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.kv_connectors import OffloadConnector, OffloadMeta
from engine.core.kv_connectors._offload_scheduler import OffloadScheduler
from engine.core.kv_connectors._offload_worker import OffloadWorker
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.sdk import KVConnectorMetadata
from engine.testing.contracts import KVConnectorReport, KVSimConfig, check_kv_connector
from engine.testing.contracts._kv_sim import KVConnectorDriver


@pytest.mark.parametrize("mode", ["directory", "directory, async", "memory", "memory, async"])
def test_offload_conforms(mode: str, tmp_path: Path) -> None:
    options: dict[str, Any] = {"load_async": "async" in mode}
    if mode.startswith("directory"):
        options["path"] = str(tmp_path)
    report = check_kv_connector(OffloadConnector, options=options)
    assert isinstance(report, KVConnectorReport)
    assert report.num_external_tokens > 0 and report.num_preempted > 0
    assert report.num_partial_chunks > 0
    if "async" in mode:
        assert report.num_async_loads > 0 and report.num_aborted_while_loading > 0
    else:
        assert report.num_async_loads == 0
    # Only a directory outlives its engine.
    assert (report.num_second_engine_tokens > 0) == mode.startswith("directory")


class _SkipsLoads(OffloadWorker):
    def wait_for_layer_load(self, layer_name: str) -> None:
        pass


class _NeverReportsLoads(OffloadWorker):
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()


class _WrongBlock(OffloadWorker):
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadMeta)
        moved = tuple(load.model_copy(update={"block_id": load.block_id % 60 + 1})
                      for load in metadata.loads)
        super().start_load_kv(metadata.model_copy(update={"loads": moved}))


class _LossyMeta(OffloadMeta):
    def to_bytes(self) -> bytes:
        return OffloadMeta(loads=self.loads).model_dump_json().encode()  # drops the saves


def _variant(worker: type[OffloadWorker] = OffloadWorker,
             meta: type[OffloadMeta] = OffloadMeta) -> type[OffloadConnector]:
    class Variant(OffloadConnector):
        name: ClassVar[str] = "broken_offload"
        scheduler_cls = OffloadScheduler
        worker_cls = worker
        metadata_cls = meta

    return Variant


class _LossyScheduler(OffloadScheduler):
    def build_connector_meta(self, scheduler_output: Any) -> OffloadMeta:
        meta = super().build_connector_meta(scheduler_output)
        return _LossyMeta(loads=meta.loads, saves=meta.saves, evictions=meta.evictions,
                          load_async=meta.load_async)


@pytest.mark.parametrize(("broken", "options", "message"), [
    (_variant(_SkipsLoads), {}, "reads wrong KV at positions"),
    (_variant(_WrongBlock), {}, "reads wrong KV at positions"),
    (_variant(_NeverReportsLoads), {"load_async": True}, "does get_finished report every"),
])
def test_broken_connectors_fail(broken: type[OffloadConnector], options: dict[str, Any],
                                message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_kv_connector(broken, options=options, seeds=range(0))


def test_metadata_that_does_not_survive_the_wire_fails() -> None:
    class Lossy(OffloadConnector):
        name: ClassVar[str] = "lossy"
        scheduler_cls = _LossyScheduler
        worker_cls = OffloadWorker
        metadata_cls = _LossyMeta

    with pytest.raises(AssertionError, match="from_bytes.to_bytes.m.. != m"):
        check_kv_connector(Lossy, seeds=range(0))


def test_a_connector_that_never_hits_needs_expect_hits_false() -> None:
    class Forgets(OffloadScheduler):
        def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
            return 0, False

    class NoStore(OffloadConnector):
        name: ClassVar[str] = "no_store"
        scheduler_cls = Forgets

    with pytest.raises(AssertionError, match="pass expect_hits=False"):
        check_kv_connector(NoStore, seeds=range(0))
    report = check_kv_connector(NoStore, expect_hits=False, seeds=range(0))
    assert report.num_external_tokens == 0


def test_the_simulated_kv_cache_has_the_engines_cpu_layout() -> None:
    """The fake worker's caches are what the built-in CPU backends allocate and write."""
    heads, size, block_size = 3, 5, 4  # all different: a swapped dimension shows
    config = KVSimConfig(block_size=block_size, num_kv_heads=heads, head_size=size,
                         num_kv_blocks=8, max_model_len=32)
    driver = KVConnectorDriver.start(OffloadConnector, OffloadConnector.Options(), config)
    for backend in (CpuAttentionBackend, TorchAttentionBackend):
        want = backend.get_kv_cache_shape(9, block_size, heads, size)
        assert all(cache.shape == want for cache in driver.worker.kv_caches.values())
    driver.add("r", list(range(10, 16)), max_tokens=1)
    driver.step()
    state = driver.worker.requests["r"]
    cache = driver.worker.kv_caches[config.layer_names[0]]
    pattern = torch.arange(2 * heads * size, dtype=torch.float32).view(2, heads, size)
    bases = []
    for position in range(6):  # the torch backend writes token t at [:, block, :, offset]
        block, offset = state.block_ids[position // block_size], position % block_size
        token = cache[:, block, :, offset]
        bases.append(token[0, 0, 0].item())
        assert torch.equal(token - bases[-1], pattern), position
    assert len(set(bases)) == 6  # one value per token, heads and elements on top
    driver.shutdown()
