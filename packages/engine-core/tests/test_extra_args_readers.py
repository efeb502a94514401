"""Any plugin kind declares the ``extra_args`` keys it takes (``Plugin.extra_args_keys``).

A scheduling policy and a KV connector that read a request's ``extra_args`` declare their
keys: requests with them are accepted (no dummy logits processor needed) and the plugins
read the values in EngineCore; a logits processor still takes its keys by reading them in
``validate_params``; a key that no plugin takes is still refused, and the message lists
the keys that are taken, by which plugin and distribution.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM
from engine.sdk import (
    KVConnector,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    RequestView,
    SamplingParams,
    SchedulerOutput,
    ValidationError,
)
from engine.sdk.groups import KV_CONNECTORS, LOGITS_PROCESSORS, SCHEDULING_POLICIES
from engine.sdk.logits_processor import BatchUpdate, LogitsProcessor
from engine.sdk.scheduling_policy import SchedulingPolicy
from engine.testing.engine import assert_kv_pool_full
from engine.testing.test_plugins import entry_installer

DIST = "engine-test-extra-args"
#: What the plugins saw in EngineCore: (plugin, request id) -> the value of their key.
SEEN: dict[tuple[str, str], Any] = {}


class TierPolicy(SchedulingPolicy):
    """Serves lower ``extra_args["tier"]`` first."""

    name = "test_tier"
    extra_args_keys = frozenset({"tier"})

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        tier = (request.sampling_params.extra_args or {}).get("tier", 0)
        SEEN["policy", request.request_id] = tier
        return (tier, request.arrival_time)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        return running[-1]


class TagScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        SEEN["connector", request.request_id] = (
            request.sampling_params.extra_args or {}).get("kv_tag")
        return 0, False

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class TagWorker(KVConnectorWorker):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pass

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class TagConnector(KVConnector):
    """Reads ``extra_args["kv_tag"]`` on its scheduler side; moves nothing."""

    name = "test_tag"
    extra_args_keys = frozenset({"kv_tag"})
    scheduler_cls = TagScheduler
    worker_cls = TagWorker


class Strength(LogitsProcessor):
    """SDK 1.0's way: takes ``strength`` by reading it in ``validate_params``."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        value = (params.extra_args or {}).get("strength")
        if value is not None and value < 0:
            raise ValidationError(f"strength must be >= 0, got {value}",
                                  param="extra_args.strength")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ENGINE_PLUGINS", raising=False)
        install = entry_installer(mp, DIST, "0.1")
        install(SCHEDULING_POLICIES, "test_tier", TierPolicy)
        install(KV_CONNECTORS, "test_tag", TagConnector)
        install(LOGITS_PROCESSORS, "test_strength", Strength)
        with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=32,
                 block_size=4, max_model_len=64, plugins=f"{DIST},engine-core",
                 scheduling_policy="test_tier", kv_connector="test_tag") as engine:
            yield engine


def generate(llm: LLM, *extras: dict[str, Any]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args=extra)
              for extra in extras]
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8 + i]} for i in range(len(extras))],
                           params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_declared_keys_are_accepted_and_the_plugins_read_them(llm: LLM) -> None:
    SEEN.clear()
    outputs = generate(llm, {"tier": 2, "kv_tag": "a"}, {"tier": 1, "strength": 3}, {})
    assert all(len(tokens) == 4 for tokens in outputs)
    policy = sorted(v for (who, _), v in SEEN.items() if who == "policy")
    connector = sorted(str(v) for (who, _), v in SEEN.items() if who == "connector")
    assert policy == [0, 1, 2]
    assert connector == ["None", "None", "a"]
    assert_kv_pool_full(llm)


def test_a_key_no_plugin_takes_is_refused_listing_who_takes_what(llm: LLM) -> None:
    with pytest.raises(ValidationError) as info:
        generate(llm, {"tierr": 1})
    assert info.value.param == "extra_args.tierr"
    message = str(info.value)
    assert message.startswith("extra_args key 'tierr' is not taken by any plugin this engine "
                              "uses (the keys they take: ")
    for taken in (f"'kv_tag' by KV connector 'test_tag' ({DIST} 0.1)",
                  f"'strength' by logits processor 'test_strength' ({DIST} 0.1)",
                  f"'tier' by scheduling policy 'test_tier' ({DIST} 0.1)"):
        assert taken in message


def test_a_processor_still_takes_and_checks_the_keys_it_reads(llm: LLM) -> None:
    assert len(generate(llm, {"strength": 0})[0]) == 4
    with pytest.raises(ValidationError, match="strength must be >= 0") as info:
        generate(llm, {"strength": -1, "tier": 1})
    assert info.value.param == "extra_args.strength"


def test_an_installed_policy_that_is_not_selected_takes_no_keys(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    entry_installer(monkeypatch, f"{DIST}-b", "0.1")(SCHEDULING_POLICIES, "test_tier_b",
                                                     TierPolicy)
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=32,
             max_model_len=64, plugins=f"{DIST}-b,engine-core") as llm, \
            pytest.raises(ValidationError, match=r"'tier' is not taken by any plugin"):
        generate(llm, {"tier": 1})
