"""``LLM.encode``: the selected IO processor offline (the ``io`` test distribution).

``test_io_prompts`` generates every prompt greedily with its own ``sampling_params``; its
``misbehave`` field makes it fail on purpose. ``test_io_words`` is installed and never
selected: its counters must stay at 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.sdk import PluginError, SamplingParams, ValidationError

IO = "engine-test-plugin-io"
PROMPTS = ["Hello", [7, 11, 13]]


@pytest.fixture
def calls(plugins_on_path: Path) -> Iterator[Any]:
    from engine_test_plugin_io import CALLS

    CALLS.clear()
    yield CALLS


@pytest.fixture
def llm(tiny_llama: Path, calls: Any) -> Iterator[LLM]:
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=64,
             plugins=IO, io_processor="test_io_prompts",
             plugin_options={"test_io_prompts": {"max_prompts": 3}}) as engine:
        yield engine


def test_encode_runs_every_hook_and_the_engine(llm: LLM, calls: Any) -> None:
    body = llm.encode({"prompts": PROMPTS, "max_tokens": 5})
    assert body["processor"] == "test_io_prompts"
    request_id = body["request_id"]
    assert [r["request_id"] for r in body["results"]] == [f"{request_id}-0", f"{request_id}-1"]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = llm.generate(["Hello", {"prompt_token_ids": [7, 11, 13]}], greedy,
                            use_tqdm=False)
    assert [(r["text"], r["token_ids"], r["finish_reason"]) for r in body["results"]] == [
        (o.outputs[0].text, o.outputs[0].token_ids, "length") for o in expected]
    assert {k: v for k, v in calls.items() if k.startswith("test_io_prompts")} == {
        "test_io_prompts.init": 1, "test_io_prompts.parse_request": 1,
        "test_io_prompts.pre_process": 1, "test_io_prompts.post_process": 1}
    assert not [k for k in calls if k.startswith("test_io_words")]  # installed, not selected


def test_options_and_validation_errors_name_the_field(llm: LLM) -> None:
    for data, param in (({"prompts": []}, "prompts"), ({"prompts": ["a"] * 4}, "prompts"),
                        ({"prompts": ["a", 7]}, "prompts[1]"),
                        ({"prompts": ["a"], "max_tokens": 0}, "max_tokens")):
        with pytest.raises(ValidationError) as info:
            llm.encode(data)
        assert info.value.param == param
    with pytest.raises(ValidationError, match=r"encode-\d+-0, a prompt IO processor "
                       r"'test_io_prompts' made from this payload, is invalid") as info:
        llm.encode({"prompts": [[10**6]]})  # a token id the vocabulary does not have
    assert llm.llm_engine.output_processor.has_unfinished_requests() is False


@pytest.mark.parametrize(("misbehave", "cause"), [
    ("raise_in_parse", "parse_request raised RuntimeError: test_io_prompts fails in "
                       "parse_request on purpose"),
    ("raise_in_pre", "pre_process raised RuntimeError"),
    ("raise_in_post", "post_process raised RuntimeError"),
    ("no_prompts", "pre_process must return a non-empty sequence of ProcessedPrompt"),
    ("not_a_prompt", "pre_process returned 'Hello' at index 0, not an engine.sdk."
                     "ProcessedPrompt"),
    ("n_2", "prompt 0 of pre_process asks for n=2"),
])
def test_a_failing_processor_is_a_plugin_error_and_the_engine_keeps_serving(
        llm: LLM, misbehave: str, cause: str) -> None:
    with pytest.raises(PluginError) as info:
        llm.encode({"prompts": ["Hello"], "misbehave": misbehave})
    assert str(info.value).startswith(
        f"plugin 'test_io_prompts' (group engine.io_processors, distribution {IO} 0.1.0): "
        f"{cause}")
    assert llm.encode({"prompts": ["Hello"]})["results"][0]["finish_reason"] == "length"


def test_prompts_without_params_use_the_callers_default(tiny_llama: Path, calls: Any) -> None:
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=32,
             plugins=IO, io_processor="test_io_words") as llm:
        body = llm.encode({"text": "Hello there"},
                          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        [reference] = llm.generate("Hello there", SamplingParams(
            temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert body == {"words": len(reference.outputs[0].text.split()),
                    "continuation": reference.outputs[0].text}
    assert calls["test_io_words.post_process"] == 1 and calls["test_io_prompts.init"] == 0


def test_without_an_io_processor_encode_says_how_to_select_one(tiny_llama: Path,
                                                               plugins_on_path: Path) -> None:
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=32,
             plugins=IO) as llm:
        with pytest.raises(ValidationError, match=r"no IO processor is selected: create the "
                           r"engine with LLM\(\.\.\., io_processor=NAME\).*installed: "
                           r"test_io_prompts, test_io_words") as info:
            llm.encode({"prompts": ["Hello"]})
    assert info.value.param == "io_processor"


def test_an_unknown_io_processor_stops_start_up(tiny_llama: Path, plugins_on_path: Path,
                                               ) -> None:
    with pytest.raises(PluginError, match="no plugin named 'test_io_nope' in group "
                       "engine.io_processors. Available: test_io_prompts, test_io_words"):
        LLM(str(tiny_llama), in_process=True, plugins=IO, io_processor="test_io_nope")
    with pytest.raises(PluginError, match="'test_io_prompts' .*invalid --plugin-option "
                       "test_io_prompts: max_prompts: Input should be greater than or equal "
                       "to 1 \\(got 0\\). Accepted options: max_prompts"):
        LLM(str(tiny_llama), in_process=True, plugins=IO, io_processor="test_io_prompts",
            plugin_options={"test_io_prompts": {"max_prompts": 0}})
