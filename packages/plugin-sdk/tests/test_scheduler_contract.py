"""Scheduler data contracts: frozen, consistent, and plain values only."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from engine.sdk import (
    CachedRequestData,
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    NewRequestData,
    RequestStatus,
    SamplingParams,
    SchedulerContext,
    SchedulerInterface,
    SchedulerOutput,
)


def make_output() -> SchedulerOutput:
    new = NewRequestData("a", (1, 2, 3), SamplingParams(), (4,), 0)
    cached = CachedRequestData(("b",), ((5,),), (17,))
    return SchedulerOutput((new,), cached, {"a": 3, "b": 1}, 4, frozenset({"c"}))


def test_outputs_are_frozen_and_picklable() -> None:
    out = make_output()
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.total_num_scheduled_tokens = 0  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(out)) == out
    runner = ModelRunnerOutput(("a", "b"), ((9,), (8,)))
    assert pickle.loads(pickle.dumps(runner)) == runner


def test_cached_request_data_checks_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per request"):
        CachedRequestData(("a", "b"), ((1,),), (0, 0))


def test_request_status_finish_reasons() -> None:
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    assert RequestStatus.RUNNING.finish_reason is None
    assert [s.is_finished for s in RequestStatus] == [False, False, False, True, True, True,
                                                       True]


def test_engine_core_output_finished() -> None:
    assert EngineCoreOutput("a", (1,), finish_reason="length").finished
    assert not EngineCoreOutput("a", (1,)).finished


def test_scheduler_interface_is_abstract() -> None:
    ctx = SchedulerContext(block_size=16, num_kv_blocks=8, max_num_seqs=2,
                           max_num_batched_tokens=64, max_model_len=128)
    with pytest.raises(TypeError, match="abstract"):
        SchedulerInterface(ctx)  # type: ignore[abstract]
    request = EngineRequest("r", (1, 2), SamplingParams())
    assert request.priority == 0
