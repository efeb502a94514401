"""Stop conditions, per-request outputs and validation of the default scheduler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from engine.core.scheduler import Request, Scheduler
from engine.sdk import (
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    SampleLogprobs,
    SamplingParams,
    SchedulerContext,
    SchedulerOutput,
)

EOS = 2


def make_scheduler(**overrides: Any) -> Scheduler:
    values: dict[str, Any] = dict(
        block_size=4,
        num_kv_blocks=32,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    values.update(overrides)
    return Scheduler(SchedulerContext(plugin_name="default", **values))


def add(scheduler: Scheduler, request_id: str, prompt: Sequence[int], **params: Any) -> None:
    eos = params.pop("eos_token_id", EOS)
    scheduler.add_request(
        EngineRequest(request_id, tuple(prompt), SamplingParams(**params), eos_token_id=eos)
    )


def step(
    scheduler: Scheduler, next_token: Callable[[Request], int], **runner_fields: Any
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One step with a scripted runner: a request that computed all its tokens samples."""
    out = scheduler.schedule()
    req_ids, sampled = [], []
    for req_id in out.num_scheduled_tokens:
        request = scheduler.get_request(req_id)
        assert request is not None
        req_ids.append(req_id)
        done = request.num_computed_tokens == request.num_tokens
        sampled.append((next_token(request),) if done else ())
    runner = ModelRunnerOutput(tuple(req_ids), tuple(sampled), **runner_fields)
    return out, scheduler.update_from_output(out, runner)


def generate(
    script: Sequence[int], prompt: Sequence[int] = (1, 1, 1), **params: Any
) -> EngineCoreOutput:
    """Run one request whose n-th sampled token is ``script[n]``; return its merged output."""
    scheduler = make_scheduler(max_model_len=params.pop("max_model_len", 64))
    add(scheduler, "r", prompt, **params)
    tokens: list[int] = []
    last: EngineCoreOutput | None = None
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler, lambda req: script[req.num_output_tokens])
        for output in outputs:
            tokens.extend(output.new_token_ids)
            last = output
    scheduler.schedule()
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks
    assert last is not None and last.finished
    return EngineCoreOutput(
        "r", tuple(tokens), finish_reason=last.finish_reason, stop_reason=last.stop_reason
    )


def result(output: EngineCoreOutput) -> tuple[list[int], str | None, int | None]:
    return list(output.new_token_ids), output.finish_reason, output.stop_reason


# -- stop conditions -----------------------------------------------------------------


def test_eos_stops_and_is_kept() -> None:
    assert result(generate([5, EOS, 7], max_tokens=5)) == ([5, EOS], "stop", None)


def test_ignore_eos_runs_to_max_tokens() -> None:
    out = generate([EOS] * 4, max_tokens=3, ignore_eos=True)
    assert result(out) == ([EOS, EOS, EOS], "length", None)


def test_no_eos_token_never_stops_on_it() -> None:
    out = generate([EOS] * 4, max_tokens=3, eos_token_id=None)
    assert result(out) == ([EOS, EOS, EOS], "length", None)


def test_min_tokens_defers_eos_and_stop_ids() -> None:
    out = generate([EOS, EOS, EOS, 9], max_tokens=6, min_tokens=2)
    assert result(out) == ([EOS, EOS, EOS], "stop", None)
    out = generate([7, 7, 9], max_tokens=6, min_tokens=1, stop_token_ids=[7])
    assert result(out) == ([7, 7], "stop", 7)


def test_stop_token_ids_report_the_stop_reason() -> None:
    out = generate([5, 8, 7, 1], max_tokens=9, stop_token_ids=[7, 8])
    assert result(out) == ([5, 8], "stop", 8)


def test_eos_is_checked_before_the_length_cap() -> None:
    assert result(generate([5, EOS], max_tokens=2)) == ([5, EOS], "stop", None)
    out = generate([5, 7], max_tokens=2, stop_token_ids=[7])
    assert result(out) == ([5, 7], "stop", 7)


def test_max_tokens_and_max_model_len_cap_the_length() -> None:
    assert result(generate([5] * 9, max_tokens=4)) == ([5] * 4, "length", None)
    out = generate([5] * 20, prompt=[1] * 6, max_tokens=None, max_model_len=10)
    assert result(out) == ([5] * 4, "length", None)
    out = generate([5] * 20, prompt=[1] * 6, max_tokens=9, max_model_len=8)
    assert result(out) == ([5] * 2, "length", None)
    out = generate([5] * 20, prompt=[1] * 8, max_tokens=9, max_model_len=8)
    assert result(out) == ([5], "length", None)  # a full-length prompt still samples once


# -- outputs -------------------------------------------------------------------------


def test_logprobs_rows_are_sliced_per_request() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2, 3], logprobs=1)
    add(scheduler, "b", [4, 5], max_tokens=3)
    logprobs = SampleLogprobs(
        token_ids=((10, 10, 11), ()),
        logprobs=((-0.1, -0.1, -2.0), ()),
        sampled_token_ranks=(1, 0),
    )
    _, outputs = step(scheduler, lambda req: 10, logprobs=logprobs)
    by_id = {output.request_id: output for output in outputs}
    assert by_id["a"].new_logprobs == SampleLogprobs(((10, 10, 11),), ((-0.1, -0.1, -2.0),), (1,))
    assert by_id["b"].new_logprobs is None


def test_prompt_logprobs_arrive_with_each_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "a", list(range(10)), prompt_logprobs=0, max_tokens=1)
    chunk = SampleLogprobs(((1,),), ((-1.0,),), (1,))
    seen = []
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler, lambda req: 5, prompt_logprobs={"a": chunk})
        seen.append([(o.new_token_ids, o.new_prompt_logprobs is chunk) for o in outputs])
    assert seen == [[((), True)], [((), True)], [((5,), True)]]


def test_partial_chunks_sample_nothing_even_if_the_runner_sends_tokens() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "a", list(range(6)), max_tokens=1)
    out = scheduler.schedule()
    runner = ModelRunnerOutput(("a",), ((9,),))
    assert scheduler.update_from_output(out, runner) == []
    _, outputs = step(scheduler, lambda req: 5)
    assert [o.new_token_ids for o in outputs] == [(5,)]


def test_add_request_validation() -> None:
    scheduler = make_scheduler(max_model_len=16)
    add(scheduler, "a", [1, 2])
    with pytest.raises(ValueError, match="'a' is already in the scheduler"):
        add(scheduler, "a", [1, 2])
    with pytest.raises(ValueError, match="empty prompt"):
        add(scheduler, "b", [])
    with pytest.raises(ValueError, match="prompt of 17 tokens is longer than max_model_len=16"):
        add(scheduler, "c", [1] * 17)
    assert scheduler.get_num_unfinished_requests() == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_blocks": 3}, "holds 12 tokens .* fewer than max_model_len=64"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"kv_connector": object()}, "must be the scheduler side of a KV connector"),
    ],
)
def test_context_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_scheduler(**overrides)


def test_request_view_protocol_and_stats() -> None:
    from engine.sdk import RequestView

    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2, 3])
    request = scheduler.get_request("a")
    assert isinstance(request, RequestView)
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs, stats.num_free_blocks) == (1, 0, 32)
    step(scheduler, lambda req: 5)
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs) == (0, 1)
    assert stats.prefix_cache.queries == 3


def test_a_failed_request_frees_its_blocks_and_leaves_nothing_in_the_prefix_cache() -> None:
    """``finish_requests(ids, FINISHED_ERROR)``: what EngineCore calls when a plugin failed."""
    from engine.sdk import RequestStatus

    scheduler = make_scheduler()
    prompt = list(range(10, 22))  # three full blocks of 4
    add(scheduler, "failed", prompt)
    step(scheduler, lambda request: 5)
    scheduler.finish_requests(["failed"], RequestStatus.FINISHED_ERROR)
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks
    add(scheduler, "again", prompt)
    _, outputs = step(scheduler, lambda request: 5)
    assert [o.num_cached_tokens for o in outputs] == [0]  # its KV may have been incomplete
