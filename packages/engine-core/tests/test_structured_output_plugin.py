"""A structured-output backend selected by name: ``test_digits`` serves, and only when asked.

``engine-test-plugin-structured`` (installed for real, see ``engine.testing.test_plugins``)
provides ``test_digits``: regex specs only, digits only, EOS after ``min_digits``. Its
counters prove that the constrained request reached it, the unconstrained ones never did,
and that EngineCore built it only on the first constrained request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.engine.engine_core import EngineCore
from engine.sdk import PluginError, ValidationError
from engine.sdk.structured_output import StructuredOutputsParams
from engine.testing.engine import assert_kv_pool_full

STRUCTURED = "engine-test-plugin-structured"
PROMPTS = ["hello", "The cat", "1 2 3", "Once upon a time"]
OPTIONS: dict[str, Any] = {"dtype": "float32", "in_process": True, "num_kv_blocks": 64,
                           "block_size": 4}


def greedy(**structured: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=16, structured_outputs=(
        StructuredOutputsParams(**structured) if structured else None))


def token_ids(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams],
              ) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture
def calls(plugins_on_path: Path) -> Iterator[Any]:
    from engine_test_plugin_structured import CALLS

    CALLS.clear()
    yield CALLS


def test_the_selected_backend_serves_constrained_requests_only(tiny_llama: Path,
                                                               calls: Any) -> None:
    with LLM(str(tiny_llama), plugins=STRUCTURED, structured_outputs_backend="test_digits",
             plugin_options={"test_digits": {"min_digits": 5}}, **OPTIONS) as llm:
        alone = token_ids(llm, PROMPTS, greedy())
        # Unconstrained requests never reach the backend; EngineCore has not even built it.
        assert dict(calls) == {"init.frontend": 1}
        [digits] = llm.generate(PROMPTS[0], greedy(regex="ignored"), use_tqdm=False)
        mixed = llm.generate(PROMPTS, [greedy(regex="ignored"), greedy()] * 2, use_tqdm=False)
        for out in [digits, mixed[0], mixed[2]]:
            text = out.outputs[0].text
            assert text.isascii() and text.isdigit() and len(text) >= 5, out
        assert [o.outputs[0].token_ids for o in mixed[1::2]] == alone[1::2]
        assert calls["init.engine_core"] == 1
        assert calls["validate"] == 3 and calls["matcher"] == 3
        assert calls["compile"] == 1  # the same spec thrice: compiled once, cached
        num_tokens = sum(len(o.outputs[0].token_ids) for o in [digits, mixed[0], mixed[2]])
        assert calls["accept_tokens"] == num_tokens
        assert calls["fill_bitmask.rows"] >= num_tokens
        with pytest.raises(ValidationError, match="structured_outputs.json is not served by "
                           "the test_digits backend; it serves structured_outputs.regex only"):
            llm.generate(PROMPTS[0], greedy(json={"type": "object"}), use_tqdm=False)
        assert_kv_pool_full(llm)
        core = llm.llm_engine.core
        assert isinstance(core, EngineCore) and core.structured_output._matchers == {}
    assert calls["shutdown"] == 1  # EngineCore's backend; the front end's never compiles


def test_the_digits_matcher_allows_eos_after_min_digits(tiny_llama: Path,
                                                        plugins_on_path: Path) -> None:
    from engine_test_plugin_structured import DigitsBackend
    from transformers import AutoTokenizer

    from engine.core.structured_output.bitmask import allowed_tokens
    from engine.sdk.structured_output import StructuredOutputContext

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    backend = DigitsBackend(StructuredOutputContext(
        plugin_name="test_digits", options=DigitsBackend.Options(min_digits=2),
        tokenizer=tokenizer, vocab_size=512, eos_token_ids=(2,)))
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="x")))
    digits = tokenizer.encode("0123456789", add_special_tokens=False)

    def allowed() -> list[int]:
        bitmask = torch.zeros((1, 16), dtype=torch.int32)
        backend.fill_bitmask([matcher], bitmask)
        return list(allowed_tokens(bitmask, 512)[0].nonzero().flatten().tolist())

    assert allowed() == sorted(digits)
    assert matcher.accept_tokens(digits[:1]) and allowed() == sorted(digits)
    assert not matcher.accept_tokens([2])  # one digit is not enough
    assert matcher.accept_tokens(digits[1:2]) and allowed() == sorted([2, *digits])
    assert matcher.accept_tokens([2]) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated()


def test_an_unknown_backend_stops_start_up(tiny_llama: Path, plugins_on_path: Path) -> None:
    with pytest.raises(PluginError, match="no plugin named 'test_nope' in group "
                       "engine.structured_output_backends. Available: .*test_digits"):
        LLM(str(tiny_llama), plugins=STRUCTURED, structured_outputs_backend="test_nope",
            **OPTIONS)
