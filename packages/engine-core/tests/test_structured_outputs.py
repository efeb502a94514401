"""Structured outputs end to end on the tiny checkpoint: valid output, untouched neighbours.

One in-process engine (the built-in ``xgrammar`` backend) serves most scenarios, greedy;
after each, every KV block is free again and EngineCore holds no matcher and no pending
compile. A backend that raises (registered from this module) fails only the constrained
requests; TP=2 on the ``mp`` executor sends the bitmask over the worker wire. A plugin
backend selected by name: ``test_structured_output_plugin.py``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.engine.engine_core import EngineCore
from engine.core.rpc.worker_convert import scheduler_output_from_proto, scheduler_output_to_proto
from engine.core.structured_output.xgrammar_backend import XgrammarBackend
from engine.sdk import ValidationError
from engine.sdk.groups import STRUCTURED_OUTPUT_BACKENDS
from engine.sdk.scheduler import CachedRequestData, EngineRequest, SchedulerOutput
from engine.sdk.structured_output import (
    GrammarBitmask,
    StructuredOutputMatcher,
    StructuredOutputsParams,
)
from engine.testing.engine import assert_kv_pool_full
from engine.testing.test_plugins import entry_installer

PROMPTS = ["hello", "The cat", "1 2 3", "Once upon a time"]
OPTIONS: dict[str, Any] = {"dtype": "float32", "in_process": True, "num_kv_blocks": 64,
                           "block_size": 4}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[0-9]{2}\.(com|org)"
CHOICES = ("alpha", "beta", "gamma delta")
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]?'
GRAMMAR_RE = r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)"


def greedy(max_tokens: int = 16, **structured: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=(
        StructuredOutputsParams(**structured) if structured else None))


def generate(llm: LLM, prompts: Sequence[str], params: SamplingParams | list[SamplingParams],
             ) -> list[Any]:
    """Every prompt's first completion (text, token_ids, finish_reason, error)."""
    return [o.outputs[0] for o in llm.generate(list(prompts), params, use_tqdm=False)]


def core_of(llm: LLM) -> EngineCore:
    """The engine's EngineCore (in this process)."""
    core = llm.llm_engine.core
    assert isinstance(core, EngineCore)
    return core


def assert_clean(llm: LLM) -> None:
    """The pool is full again and EngineCore keeps nothing of a constrained request."""
    assert_kv_pool_full(llm)
    manager = core_of(llm).structured_output
    assert not manager.has_pending()
    assert manager._matchers == {}


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Iterator[LLM]:
    with LLM(str(tiny_llama), plugins="none", **OPTIONS) as engine:
        yield engine


@pytest.fixture(scope="module")
def plain(llm: LLM) -> list[list[int]]:
    """Each prompt's greedy tokens without any constraint in the engine."""
    return [c.token_ids for c in generate(llm, PROMPTS, greedy())]


# -- what each kind of constraint gives ----------------------------------------------------------

def test_json_schema_output_validates(llm: LLM) -> None:
    outs = generate(llm, PROMPTS, greedy(96, json=SCHEMA, disable_any_whitespace=True))
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert_clean(llm)


def test_regex_output_matches(llm: LLM) -> None:
    for out in generate(llm, PROMPTS, greedy(24, regex=REGEX)):
        assert out.finish_reason == "stop"
        assert re.fullmatch(REGEX, out.text), out.text
    assert_clean(llm)


def test_choice_output_is_one_of_the_choices(llm: LLM) -> None:
    outs = generate(llm, PROMPTS, greedy(choice=CHOICES))
    assert all(o.text in CHOICES and o.finish_reason == "stop" for o in outs), outs
    assert_clean(llm)


def test_ebnf_grammar_output_is_in_the_language(llm: LLM) -> None:
    for out in generate(llm, PROMPTS, greedy(24, grammar=GRAMMAR)):
        assert out.finish_reason == "stop"
        assert re.fullmatch(GRAMMAR_RE, out.text), out.text
    assert_clean(llm)


def test_json_object_parses_as_an_object_when_it_stops(llm: LLM) -> None:
    outs = generate(llm, PROMPTS, greedy(48, json_object=True, disable_any_whitespace=True))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped
    assert all(isinstance(json.loads(o.text), dict) for o in stopped)
    assert all(o.text.startswith("{") for o in outs)
    assert_clean(llm)


# -- constrained and unconstrained in one batch -------------------------------------------------

def test_unconstrained_requests_keep_their_tokens_in_a_mixed_batch(
        llm: LLM, plain: list[list[int]]) -> None:
    constrained = [greedy(24, regex=REGEX), greedy(choice=CHOICES),
                   greedy(96, json=SCHEMA, disable_any_whitespace=True),
                   greedy(24, grammar=GRAMMAR)]
    prompts = [p for p in PROMPTS for _ in range(2)]
    params = [p for c in constrained for p in (c, greedy())]
    outs = generate(llm, prompts, params)
    assert [o.token_ids for o in outs[1::2]] == plain
    assert re.fullmatch(REGEX, outs[0].text) and outs[2].text in CHOICES
    jsonschema.validate(json.loads(outs[4].text), SCHEMA)
    assert re.fullmatch(GRAMMAR_RE, outs[6].text)
    assert_clean(llm)


def test_n2_seeded_sampling_gives_two_valid_choices(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    [out] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    again = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    for choice in out.outputs:
        assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.text), choice
    assert [c.text for c in again.outputs] == [c.text for c in out.outputs]  # seeded
    assert_clean(llm)


def test_ignore_eos_stops_when_the_grammar_is_complete(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    for out in generate(llm, PROMPTS, params):
        assert out.finish_reason == "stop" and out.text in CHOICES
        assert len(out.token_ids) < 32
    assert_clean(llm)


@pytest.mark.parametrize("options", [
    {"num_kv_blocks": 16, "max_model_len": 48},  # 64 tokens for ~90: someone is preempted
    {"max_num_batched_tokens": 4, "max_num_seqs": 2},  # prompts prefilled in chunks
], ids=["preemption", "chunked-prefill"])
def test_constrained_tokens_survive_preemption_and_chunked_prefill(
        llm: LLM, tiny_llama: Path, options: dict[str, Any]) -> None:
    params = [greedy(24, regex=REGEX), greedy(24, grammar=GRAMMAR), greedy(choice=CHOICES),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    reference = [o.token_ids for o in generate(llm, PROMPTS, params)]
    with LLM(str(tiny_llama), plugins="none", **{**OPTIONS, **options}) as small:
        scheduler = core_of(small).scheduler
        schedule, preempted = scheduler.schedule, list[str]()

        def counting() -> SchedulerOutput:
            out = schedule()
            preempted.extend(out.preempted_req_ids)
            return out

        scheduler.schedule = counting  # type: ignore[method-assign]
        assert [o.token_ids for o in generate(small, PROMPTS, params)] == reference
        assert bool(preempted) is ("num_kv_blocks" in options)
        assert_clean(small)


# -- front-end validation -----------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "param", "message"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
     "structured_outputs.json", 'is not a JSON schema xgrammar supports: Unsupported type "nope"'),
    ({"regex": "[a-z"}, "structured_outputs.regex", "is not a valid regex"),
    ({"grammar": 'root ::= "a" rest'}, "structured_outputs.grammar",
     'is not a valid EBNF grammar: .*Rule "rest" is not defined'),
    ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar",
     'The root rule with name "root" is not found'),
])
def test_an_invalid_spec_is_refused_at_generate(llm: LLM, spec: dict[str, Any], param: str,
                                               message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        llm.generate([PROMPTS[0], PROMPTS[1]], [greedy(), SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(**spec))], use_tqdm=False)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param} ")
    assert not re.search(r"\[\d+:\d+:\d+\]|\.cc:\d+", str(info.value))
    assert_clean(llm)  # nothing was queued, not even the valid request


# -- aborts and finishes leave nothing behind ---------------------------------------------------

@pytest.fixture
def held_compiles(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every grammar compile waits until the returned event is set."""
    manager = core_of(llm).structured_output
    gate = threading.Event()
    compile_matcher = manager._matcher

    def held(params: StructuredOutputsParams) -> StructuredOutputMatcher:
        assert gate.wait(30), "the test never released the compile"
        return compile_matcher(params)

    monkeypatch.setattr(manager, "_matcher", held)
    yield gate
    gate.set()


def test_abort_while_the_grammar_compiles(llm: LLM, plain: list[list[int]],
                                          held_compiles: threading.Event) -> None:
    engine = llm.llm_engine
    core = core_of(llm)
    manager = core.structured_output
    unconstrained = engine.add_request("p", PROMPTS[0], greedy())
    engine.add_request("c", PROMPTS[1], greedy(regex="[0-9]{40}"))  # a spec not cached yet
    for _ in range(3):
        engine.step()
    assert manager.has_pending() and core.has_unfinished_requests()
    engine.abort_request("c")
    assert not manager.has_pending()
    held_compiles.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert unconstrained.outputs[0].token_ids == plain[0]
    assert core.step() == []  # the finished compile is dropped, not scheduled
    assert_clean(llm)

    # EngineCore directly: a request aborted before its first step never reaches the scheduler.
    held_compiles.clear()
    core.add_request(EngineRequest("d", (5, 6, 7), greedy(regex="[a-c]{30}")))
    assert manager.has_pending()
    core.abort_requests(["d"])
    held_compiles.set()
    assert core.step() == [] and not core.has_unfinished_requests()
    assert_clean(llm)


def test_abort_mid_generation_and_finish_drop_the_matcher(llm: LLM) -> None:
    engine = llm.llm_engine
    manager = core_of(llm).structured_output
    aborted = engine.add_request("a", PROMPTS[0], greedy(64, regex="[a-z]{60}"))
    finished = engine.add_request("f", PROMPTS[1], greedy(choice=CHOICES))
    while not finished.finished:
        engine.step()
    assert set(manager._matchers) == {"0_a"}  # "f" finished: its matcher is gone
    engine.abort_request("a")
    assert manager._matchers == {}
    while engine.has_unfinished_requests():
        engine.step()
    assert 0 < len(aborted.outputs[0].token_ids) < 60
    assert finished.outputs[0].text in CHOICES
    assert_clean(llm)


# -- a backend that raises fails its requests only ----------------------------------------------

class FaultyBackend(XgrammarBackend):
    """xgrammar, except that the hook named by :attr:`fail_in` raises."""

    fail_in: ClassVar[str | None] = None

    def compile(self, params: StructuredOutputsParams) -> Any:
        if FaultyBackend.fail_in == "compile":
            raise RuntimeError("compile fails on purpose")
        return super().compile(params)

    def matcher(self, grammar: Any) -> StructuredOutputMatcher:
        return FaultyMatcher(super().matcher(grammar))

    def fill_bitmask(self, matchers: Sequence[StructuredOutputMatcher],
                     bitmask: torch.Tensor) -> None:
        if FaultyBackend.fail_in == "fill_bitmask":
            raise RuntimeError("fill_bitmask fails on purpose")
        super().fill_bitmask(matchers, bitmask)


class FaultyMatcher(StructuredOutputMatcher):
    def __init__(self, inner: StructuredOutputMatcher) -> None:
        self.inner = inner

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        if FaultyBackend.fail_in == "accept_tokens":
            raise RuntimeError("accept_tokens fails on purpose")
        return self.inner.accept_tokens(token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


@pytest.fixture(scope="module")
def faulty_llm(tiny_llama: Path) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp:
        entry_installer(mp, "engine-test-structured-faults", "0.1")(
            STRUCTURED_OUTPUT_BACKENDS, "test_faulty", FaultyBackend)
        with LLM(str(tiny_llama), structured_outputs_backend="test_faulty", **OPTIONS) as engine:
            yield engine


@pytest.mark.parametrize("hook", ["compile", "fill_bitmask", "accept_tokens"])
def test_a_raising_backend_fails_only_the_constrained_requests(
        faulty_llm: LLM, plain: list[list[int]], hook: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FaultyBackend, "fail_in", hook)
    params = [greedy(24, regex=REGEX), greedy(), greedy(choice=CHOICES), greedy()]
    outs = generate(faulty_llm, PROMPTS, params)
    prefix = ("plugin 'test_faulty' (group engine.structured_output_backends, distribution "
              "engine-test-structured-faults 0.1): ")
    for out in outs[0::2]:
        assert out.finish_reason == "error"
        assert out.error is not None
        assert out.error.message.startswith(prefix), out.error.message
        assert f"{hook} fails on purpose" in out.error.message
    assert [o.token_ids for o in outs[1::2]] == [plain[1], plain[3]]
    assert all(o.finish_reason == "length" for o in outs[1::2])
    assert_clean(faulty_llm)
    monkeypatch.setattr(FaultyBackend, "fail_in", None)  # and the engine keeps serving
    [ok] = generate(faulty_llm, PROMPTS[:1], greedy(24, regex=REGEX))
    assert ok.finish_reason == "stop" and re.fullmatch(REGEX, ok.text)
    assert_clean(faulty_llm)


# -- the spec over the EngineCore wire, the bitmask over the worker wire ------------------------

@pytest.mark.parametrize("spec", [
    {"json": SCHEMA, "disable_any_whitespace": True}, {"json_object": True}, {"regex": REGEX},
    {"choice": CHOICES}, {"grammar": GRAMMAR}])
def test_sampling_params_round_trip_keeps_the_spec(spec: dict[str, Any]) -> None:
    from engine.core.rpc import convert

    params = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(**spec))
    msg = convert.sampling_params_to_proto(params)
    back = convert.sampling_params_from_proto(type(msg).FromString(msg.SerializeToString()))
    assert back == params
    assert back.structured_outputs is not None
    assert back.structured_outputs.key == StructuredOutputsParams(**spec).key


def test_scheduler_output_round_trip_keeps_the_grammar_bitmask() -> None:
    bitmask = torch.tensor([[0, -1, 1 << 30], [-(1 << 31), 5, 0]], dtype=torch.int32)
    out = SchedulerOutput((), CachedRequestData(("a", "b"), ((), ()), (5, 6)),
                          {"a": 1, "b": 1}, 2, grammar_bitmask=GrammarBitmask(("b", "a"),
                                                                              bitmask))
    msg = scheduler_output_to_proto(out)
    back = scheduler_output_from_proto(type(msg).FromString(msg.SerializeToString()))
    assert back.grammar_bitmask is not None
    assert back.grammar_bitmask.req_ids == ("b", "a")
    assert back.grammar_bitmask.bitmask.dtype == torch.int32
    assert torch.equal(back.grammar_bitmask.bitmask, bitmask)
    plain_msg = scheduler_output_to_proto(SchedulerOutput((), CachedRequestData(), {}, 0))
    assert not plain_msg.HasField("grammar_bitmask")
    assert scheduler_output_from_proto(plain_msg).grammar_bitmask is None


def test_tp2_on_mp_gives_the_constrained_tokens_of_uni(tiny_llama: Path, llm: LLM) -> None:
    params = [greedy(24, regex=REGEX), greedy(), greedy(choice=CHOICES),
              greedy(96, json=SCHEMA, disable_any_whitespace=True)]
    reference = [o.token_ids for o in generate(llm, PROMPTS, params)]
    with LLM(str(tiny_llama), plugins="none", tensor_parallel_size=2, **OPTIONS) as tp2:
        assert core_of(tp2).executor.backend == "mp"
        assert [o.token_ids for o in generate(tp2, PROMPTS, params)] == reference
        assert_clean(tp2)
