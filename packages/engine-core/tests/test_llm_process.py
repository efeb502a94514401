"""``LLM`` with EngineCore in its own process (the default) against ``in_process=True``."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM, SamplingParams
from engine.core.messages import EngineDeadError
from engine.testing.engine import assert_kv_pool_full

PROMPTS: list[Any] = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 9, 41)]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=(40,)),
    SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=8, ignore_eos=True),
]
OPTIONS: dict[str, Any] = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 128}


def summary(outputs: list[Any]) -> list[Any]:
    """What a user reads from each choice: tokens, text, finish reason, logprobs."""
    return [[(c.token_ids, c.text, c.finish_reason,
              [{k: round(v.logprob, 5) for k, v in step.items()} for step in c.logprobs or []])
             for c in o.outputs] for o in outputs]


def engine_core_pid(llm: LLM) -> int:
    pid = llm.llm_engine.core.client.pid  # type: ignore[union-attr]
    assert isinstance(pid, int)
    return pid


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): it must also be reaped.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not is_running(pid):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def in_process(tiny_llama: Path) -> list[Any]:
    with LLM(str(tiny_llama), in_process=True, **OPTIONS) as llm:
        return summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


def test_own_process_gives_the_in_process_outputs_and_frees_every_block(
        tiny_llama: Path, in_process: list[Any]) -> None:
    before = os.environ.get("GLIBC_TUNABLES")
    with LLM(str(tiny_llama), **OPTIONS) as llm:
        assert engine_core_pid(llm) != os.getpid()
        if sys.platform.startswith("linux"):  # spawned with huge-page malloc; ours untouched
            with open(f"/proc/{engine_core_pid(llm)}/environ", "rb") as environ:
                assert b"glibc.malloc.hugetlb=" in environ.read()
            assert os.environ.get("GLIBC_TUNABLES") == before
        assert summary(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == in_process
        assert_kv_pool_full(llm)
        # A request aborted while running frees its blocks in the other process too.
        engine = llm.llm_engine
        engine.add_request("abort-me", PROMPTS[3], SamplingParams(max_tokens=200,
                                                                  ignore_eos=True))
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass
        engine.abort_request("abort-me")
        assert not engine.has_unfinished_requests()
        deadline = time.monotonic() + 5
        while engine.core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_kv_pool_full(llm)


def test_shutdown_and_garbage_collection_leave_no_process_or_socket(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), **OPTIONS)
    pid = engine_core_pid(llm)
    socket_dir = llm.llm_engine.core.client.socket_dir  # type: ignore[union-attr]
    assert socket_dir is not None and os.path.isdir(socket_dir)
    assert is_running(pid)
    llm.shutdown()
    assert wait_gone(pid, timeout=0.5)
    assert not os.path.exists(socket_dir)
    llm.shutdown()  # idempotent
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)

    forgotten = LLM(str(tiny_llama), **OPTIONS)
    pid = engine_core_pid(forgotten)
    del forgotten
    gc.collect()
    assert wait_gone(pid)


def test_killed_engine_core_fails_generate_with_its_exit(tiny_llama: Path) -> None:
    with LLM(str(tiny_llama), **OPTIONS) as llm:
        pid = engine_core_pid(llm)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=50, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - start < 5
        assert wait_gone(pid, timeout=1)


def test_engine_core_start_up_error_reaches_the_caller(tiny_llama: Path) -> None:
    # Only EngineCore sizes the KV cache: the error comes from the other process.
    with pytest.raises(EngineDeadError, match="EngineCore failed to start.*KV") as info:
        LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=2)
    assert "max_model_len" in str(info.value) or "max-model-len" in str(info.value)


SCRIPT = """
import sys
from engine.core import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", block_size=4, num_kv_blocks=128)
    print(llm.llm_engine.core.client.pid, flush=True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    # no shutdown(): the interpreter's exit must stop EngineCore cleanly
"""


def test_a_script_that_never_shuts_down_exits_cleanly(tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tiny_llama)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert wait_gone(int(done.stdout.split()[0]), timeout=2)


def test_a_script_without_a_main_guard_is_told_why(tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.replace('if __name__ == "__main__":', "if True:"))
    done = subprocess.run([sys.executable, str(script), str(tiny_llama)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "EngineDeadError" in last and 'if __name__ == "__main__":' in last
