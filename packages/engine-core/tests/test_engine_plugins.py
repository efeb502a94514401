"""Installed plugins reach the engine: each is called, and requests not using it are untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core import LLM, SamplingParams
from engine.sdk import ValidationError
from engine.testing.engine import assert_kv_pool_full

PROMPT = {"prompt_token_ids": [7, 11, 13, 17, 19, 23]}


def test_logits_processor_plugin_is_reached_and_selective(
    tiny_llama: Path, plugins_on_path: Path
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
              plugins="engine-test-plugin-good")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [plain] = llm.generate(PROMPT, greedy, use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    banned = greedy.replace(extra_args={"ban_token": first})
    outputs = llm.generate([PROMPT, PROMPT], [banned, greedy], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids[0] != first  # the plugin changed this request
    assert first not in outputs[0].outputs[0].token_ids
    assert outputs[1].outputs[0].token_ids == plain.outputs[0].token_ids  # untouched
    with pytest.raises(ValidationError, match="ban_token"):  # validate_params, front end
        llm.generate(PROMPT, greedy.replace(extra_args={"ban_token": "x"}), use_tqdm=False)
    assert_kv_pool_full(llm)


def test_scheduling_policy_plugin_decides_the_order(
    tiny_llama: Path, plugins_on_path: Path
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, max_num_seqs=1, in_process=True,
              plugins="engine-test-plugin-good", scheduling_policy="test_good_lifo")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for request_id in ("first", "second", "third"):
        engine.add_request(request_id, PROMPT, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    # One request at a time, newest first: last come, first served.
    assert finished == ["third", "second", "first"]
    assert_kv_pool_full(llm)


def test_a_policys_extra_args_key_reaches_it_across_processes(
    tiny_llama: Path, plugins_on_path: Path
) -> None:
    # EngineCore in its own process: the keys of its policy reach the front end in EngineInfo.
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, max_num_seqs=1,
              plugins="engine-test-plugin-good", scheduling_policy="test_good_lifo")
    with llm:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        first = params.replace(extra_args={"test_good_lifo_first": True})
        outputs = llm.generate([PROMPT] * 3, [first, params, params], use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
        with pytest.raises(ValidationError, match=r"'test_good_lifo_firts' is not taken .*"
                           r"'test_good_lifo_first' by scheduling policy 'test_good_lifo' "
                           r"\(engine-test-plugin-good 0.1.0\)"):
            llm.generate(PROMPT, params.replace(extra_args={"test_good_lifo_firts": True}),
                         use_tqdm=False)


def test_the_policys_key_puts_its_request_first(tiny_llama: Path, plugins_on_path: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, max_num_seqs=1, in_process=True,
              plugins="engine-test-plugin-good", scheduling_policy="test_good_lifo")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("first", PROMPT, params.replace(extra_args={"test_good_lifo_first": 1}))
    for request_id in ("second", "third"):
        engine.add_request(request_id, PROMPT, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["first", "third", "second"]  # the key beats last come, first served
    assert_kv_pool_full(llm)


def test_broken_plugin_stops_start_up_naming_it(tiny_llama: Path, plugins_on_path: Path) -> None:
    from engine.sdk import PluginError

    with pytest.raises(PluginError, match="engine-test-plugin-import-error 0.1.0"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugins="engine-test-plugin-import-error")


def test_plugin_classes_given_as_objects(tiny_llama: Path, plugins_on_path: Path) -> None:
    from engine_test_plugin_good.processors import BanTokenProcessor

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # Importable by path: becomes 'module:Class' and reaches EngineCore's own process.
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, plugins="none",
             logits_processors=[BanTokenProcessor]) as llm:
        assert llm.llm_engine.config.logits_processors == (
            "engine_test_plugin_good.processors:BanTokenProcessor",)
        [plain] = llm.generate(PROMPT, greedy, use_tqdm=False)
        first = plain.outputs[0].token_ids[0]
        [banned] = llm.generate(PROMPT, greedy.replace(extra_args={"ban_token": first}),
                                use_tqdm=False)
        assert first not in banned.outputs[0].token_ids

    class LocalBan(BanTokenProcessor):  # defined in a function: not importable by path
        pass

    with pytest.raises(ValidationError, match="LocalBan.*cannot be imported by EngineCore's "
                       "process.*in_process=True"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, plugins="none",
            logits_processors=[LocalBan])
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, plugins="none",
             logits_processors=[LocalBan], in_process=True) as llm:
        [banned] = llm.generate(PROMPT, greedy.replace(extra_args={"ban_token": first}),
                                use_tqdm=False)
        assert first not in banned.outputs[0].token_ids
        assert_kv_pool_full(llm)
