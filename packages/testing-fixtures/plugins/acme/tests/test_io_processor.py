"""acme_classify: payload checks, prompts and labels; offline through LLM.encode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from acme_engine_plugins.io_processor import Classifier

from engine.sdk import GenerationResult, IOProcessorContext, ValidationError

LABELS = ["spam", "ham"]


def make(**options: Any) -> Classifier:
    return Classifier(IOProcessorContext(options=Classifier.Options(**options),
                                         max_model_len=256))


def test_round_trip() -> None:
    proc = make(prompt_template="Q: {text}\nA:")
    request = proc.parse_request({"texts": ["buy now", "hi mom"], "labels": LABELS})
    prompts = proc.pre_process(request, request_id="r")
    assert [p.text for p in prompts] == ["Q: buy now\nA:", "Q: hi mom\nA:"]
    params = prompts[0].sampling_params
    assert params is not None and params.temperature == 0
    assert params.structured_outputs is not None and list(
        params.structured_outputs.choice or ()) == LABELS
    results = [GenerationResult("r-0", "spam", (1,), "stop"),
               GenerationResult("r-1", "ham", (2,), "stop")]
    assert proc.post_process(results, "r") == {"labels": ["spam", "ham"]}


@pytest.mark.parametrize(("body", "param"), [
    ({"texts": [], "labels": LABELS}, "texts"),
    ({"texts": ["a"], "labels": ["only"]}, "labels"),
    ({"texts": ["a", ""], "labels": LABELS}, "texts"),
    ({"texts": ["a"] * 3, "labels": LABELS}, "texts"),  # max_texts=2 below
])
def test_bad_payloads_are_400s(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        make(max_texts=2).parse_request(body)
    assert info.value.param == param


def test_offline_each_text_gets_one_of_the_labels(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
) -> None:
    calls = spy(Classifier, "post_process")
    with make_llm(tiny_qwen3, io_processor="acme_classify") as llm:
        body = llm.encode({"texts": ["win a prize", "see you at lunch", "ok"],
                           "labels": LABELS})
    assert len(body["labels"]) == 3 and set(body["labels"]) <= set(LABELS)
    assert calls["post_process"] == 1


def test_not_selected_encode_says_how_to_select_one(
    tiny_qwen3: Path, make_llm: Callable[..., Any],
) -> None:
    with make_llm(tiny_qwen3) as llm, pytest.raises(ValidationError, match="io.processor"):
        llm.encode({"texts": ["x"], "labels": LABELS})
