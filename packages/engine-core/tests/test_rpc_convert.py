"""SDK data contracts <-> engine_core.proto messages: every round trip gives the original."""

from __future__ import annotations

import math
import struct

import pytest

from engine.core.messages import EngineInfo, StepOutputs
from engine.core.rpc import convert
from engine.core.rpc._gen import engine_core_pb2 as pb
from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import EngineCoreOutput, EngineRequest, RequestStatus, SampleLogprobs
from engine.sdk.stats import PrefixCacheStats, SchedulerStats


def f32(value: float) -> float:
    """``value`` rounded to float32, as logprobs travel."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def wire(message):
    """Serialise and parse again, as the channel does."""
    return type(message).FromString(message.SerializeToString())


def test_int32_packing_is_little_endian_and_bounded() -> None:
    assert convert.pack_int32([1, -2, 2**31 - 1]) == struct.pack("<3i", 1, -2, 2**31 - 1)
    assert convert.unpack_int32(convert.pack_int32(range(1000))) == tuple(range(1000))
    assert convert.unpack_int32(b"") == ()
    with pytest.raises(OverflowError):
        convert.pack_int32([2**31])
    assert convert.unpack_float32(convert.pack_float32([-math.inf, 0.5])) == (-math.inf, 0.5)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
    SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                   presence_penalty=-1.5, frequency_penalty=0.25, repetition_penalty=1.1,
                   seed=2**40, max_tokens=64, min_tokens=4, stop=("\n\n", "END"),
                   stop_token_ids=(7, 11), logprobs=5, prompt_logprobs=0,
                   logit_bias={0: -100.0, 42: 3.5, 2**31 - 1: 0.1},
                   skip_special_tokens=False, include_stop_str_in_output=True,
                   extra_args={"ban": [1, 2, 3], "nested": {"a": {"b": [1.5, None, "x"]},
                                                            "flag": True}, "int": 7}),
    SamplingParams(logit_bias={}, extra_args={}),
], ids=["defaults", "greedy-unbounded", "everything", "empty-containers"])
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    back = convert.sampling_params_from_proto(wire(convert.sampling_params_to_proto(params)))
    assert back == params


def test_none_fields_are_absent_not_zero() -> None:
    msg = convert.sampling_params_to_proto(SamplingParams(max_tokens=None))
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "logit_bias",
                 "extra_args_json"):
        assert not msg.HasField(name), name
    zeros = convert.sampling_params_to_proto(SamplingParams(seed=0, logprobs=0, logit_bias={},
                                                             extra_args={}))
    for name in ("seed", "logprobs", "logit_bias", "extra_args_json"):
        assert zeros.HasField(name), name


def test_extra_args_keep_ints_and_nesting() -> None:
    params = SamplingParams(extra_args={"k": 3, "f": 3.0, "deep": {"list": [{"x": 1}]}})
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(params))
    assert back.extra_args is not None
    assert type(back.extra_args["k"]) is int and type(back.extra_args["f"]) is float
    assert back.extra_args["deep"] == {"list": [{"x": 1}]}


def test_extra_args_that_are_not_json_are_refused() -> None:
    with pytest.raises(ValidationError, match="extra_args") as info:
        convert.sampling_params_to_proto(SamplingParams(extra_args={"fn": object()}))
    assert info.value.param == "extra_args"


def test_request_round_trip() -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    for request in (EngineRequest("r-1", (1, 2, 3, 50000), params, eos_token_id=2,
                                  arrival_time=1712345678.123456, priority=-3),
                    EngineRequest("r-2", (), params, eos_token_id=None)):
        msg = wire(convert.request_to_proto(request))
        assert msg.prompt_token_ids == struct.pack(f"<{len(request.prompt_token_ids)}i",
                                                   *request.prompt_token_ids)
        assert convert.request_from_proto(msg) == request


@pytest.mark.parametrize("status", list(RequestStatus))
def test_request_status_round_trip(status: RequestStatus) -> None:
    assert convert.request_status_from_proto(convert.request_status_to_proto(status)) is status


def test_unspecified_status_is_refused() -> None:
    with pytest.raises(ValueError, match="UNSPECIFIED"):
        convert.request_status_from_proto(pb.REQUEST_STATUS_UNSPECIFIED)


def logprobs(rows: list[list[tuple[int, float]]], ranks: list[int]) -> SampleLogprobs:
    return SampleLogprobs(token_ids=tuple(tuple(t for t, _ in row) for row in rows),
                          logprobs=tuple(tuple(f32(v) for _, v in row) for row in rows),
                          sampled_token_ranks=tuple(ranks))


def test_logprobs_round_trip_with_empty_rows() -> None:
    table = logprobs([[(5, -0.1), (9, -2.5), (1, -3.0)], [], [(7, -math.inf)]], [1, 0, 3])
    assert convert.logprobs_from_proto(wire(convert.logprobs_to_proto(table))) == table
    empty = SampleLogprobs(token_ids=(), logprobs=(), sampled_token_ranks=())
    assert convert.logprobs_from_proto(convert.logprobs_to_proto(empty)) == empty


def test_logprobs_are_float32_on_the_wire() -> None:
    table = SampleLogprobs(token_ids=((3,),), logprobs=((-0.1,),), sampled_token_ranks=(1,))
    back = convert.logprobs_from_proto(convert.logprobs_to_proto(table))
    assert back.logprobs == ((f32(-0.1),),)


def test_inconsistent_logprobs_message_is_refused() -> None:
    msg = pb.SampleLogprobs(token_ids=convert.pack_int32([1, 2]),
                            logprobs=convert.pack_float32([0.0, 0.0]),
                            row_lengths=convert.pack_int32([1]),
                            sampled_token_ranks=convert.pack_int32([1]))
    with pytest.raises(ValueError, match="row lengths"):
        convert.logprobs_from_proto(msg)


OUTPUTS = [
    EngineCoreOutput("a", (17,)),
    EngineCoreOutput("b", (3, 4, 5), new_logprobs=logprobs([[(3, -0.5)], [(4, -1.0)],
                                                             [(5, -0.25)]], [1, 1, 2]),
                     new_prompt_logprobs=logprobs([[], [(8, -4.0), (3, -0.5)]], [0, 2]),
                     num_cached_tokens=32),
    EngineCoreOutput("c", (2,), finish_reason="stop", stop_reason=2),
    EngineCoreOutput("d", (), finish_reason="abort"),
    EngineCoreOutput("e", (9,), finish_reason="length", stop_reason=0),
]


def test_step_outputs_round_trip() -> None:
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.375,
                           num_free_blocks=80, num_total_blocks=128,
                           prefix_cache=PrefixCacheStats(queries=64, hits=48, reset=True),
                           num_preempted_reqs=2,
                           connector_prefix_cache=PrefixCacheStats(queries=16, hits=8))
    msg = wire(convert.step_outputs_to_proto(OUTPUTS, stats, 1712345678.5))
    assert convert.step_outputs_from_proto(msg) == StepOutputs(
        outputs=OUTPUTS, scheduler_stats=stats, timestamp=1712345678.5)
    bare = convert.step_outputs_from_proto(wire(convert.step_outputs_to_proto([], None, 0.0)))
    assert bare == StepOutputs(outputs=[], scheduler_stats=None, timestamp=0.0)


def test_stats_and_info_round_trip() -> None:
    assert convert.stats_from_proto(wire(convert.stats_to_proto(SchedulerStats()))) == (
        SchedulerStats())
    with_connector = SchedulerStats(connector_prefix_cache=PrefixCacheStats())  # all zero
    assert convert.stats_from_proto(wire(convert.stats_to_proto(with_connector))) == (
        with_connector)
    info = EngineInfo(model_name="tiny", max_model_len=256, num_kv_blocks=128, block_size=16,
                      vocab_size=512)
    assert convert.info_from_proto(wire(convert.info_to_proto(info))) == info
    taking = EngineInfo(model_name="tiny", max_model_len=256, num_kv_blocks=128, block_size=16,
                        vocab_size=512, extra_args_keys={
                            "tier": ("scheduling policy 'tiered' (acme 0.1)",),
                            "both": ("scheduler 'x'", "KV connector 'y' (acme 0.1)")})
    assert convert.info_from_proto(wire(convert.info_to_proto(taking))) == taking


def test_token_ids_are_packed_bytes_not_varints() -> None:
    msg = convert.step_outputs_to_proto([EngineCoreOutput("a", tuple(range(100)))], None, 0.0)
    assert msg.outputs[0].new_token_ids == struct.pack("<100i", *range(100))
