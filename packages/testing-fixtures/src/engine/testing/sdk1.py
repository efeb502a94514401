"""Helpers of the frozen SDK 1.0 plugin tests (``tests/integration/test_sdk1_*.py``).

``packages/testing-fixtures/plugins/sdk1`` (distribution ``engine-test-plugin-sdk1``) was
written once against engine-plugin-sdk 1.0.0 and is never edited; the tests install it
(the ``sdk1`` / ``sdk1_plugin_dir`` fixtures of ``tests/integration/conftest.py``) and
prove that each of its plugins is still reached and still selective. Its plugins count
what the engine calls in ``engine_test_plugin_sdk1.counters.CALLS``: :func:`counting`
gives the calls made inside a block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.sdk import SamplingParams
from engine.sdk import groups as sdk_groups
from engine.testing.test_plugins import PLUGINS_SOURCE

DIST = "engine-test-plugin-sdk1"
SDK1_SOURCE = PLUGINS_SOURCE / "sdk1"

#: Every entry of the distribution, by group.
ENTRIES = {
    sdk_groups.GENERAL_PLUGINS: "sdk1_register",
    sdk_groups.PLATFORMS: "sdk1_cpu",
    sdk_groups.MODELS: "Sdk1LlamaForCausalLM",
    sdk_groups.ATTENTION_BACKENDS: "sdk1_paged",
    sdk_groups.QUANTIZATION: "sdk1_int8",
    sdk_groups.LINEAR_KERNELS: "sdk1_matmul",
    sdk_groups.CUSTOM_OPS: "rms_norm",
    sdk_groups.KV_CONNECTORS: "sdk1_store",
    sdk_groups.SCHEDULERS: "sdk1_fcfs",
    sdk_groups.SCHEDULING_POLICIES: "sdk1_shortest_first",
    sdk_groups.LOGITS_PROCESSORS: "sdk1_no_repeat",
    sdk_groups.WORKER_EXTENSIONS: "sdk1_inspect",
    sdk_groups.STAT_LOGGERS: "sdk1_totals",
    sdk_groups.ENDPOINTS: "sdk1_status",
    sdk_groups.IO_PROCESSORS: "sdk1_batch",
}

#: Three prompts: short, longer than two 16-token blocks, and one greedy decoding repeats.
PROMPTS = ([7, 11, 13, 17, 19, 23], list(range(30, 70)), [5] * 20)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def sdk1_llm(checkpoint: Path, **kwargs: Any) -> Any:
    """An in-process ``LLM`` on ``checkpoint`` that allows the sdk1 distribution."""
    from engine.core import LLM

    kwargs.setdefault("plugins", DIST)
    kwargs.setdefault("num_kv_blocks", 128)
    return LLM(str(checkpoint), dtype=kwargs.pop("dtype", "float32"), in_process=True,
               **kwargs)


def greedy(llm: Any, prompts: Sequence[Sequence[int]] = PROMPTS,
           params: SamplingParams | Sequence[SamplingParams] = GREEDY) -> list[list[int]]:
    """The output token ids of ``prompts`` (token-id prompts) under ``params``."""
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """What the sdk1 plugins counted inside the block (filled in at its end)."""
    from engine_test_plugin_sdk1.counters import CALLS

    before = Counter(CALLS)
    diff: Counter[str] = Counter()
    yield diff
    diff.update({key: value - before[key] for key, value in CALLS.items()
                 if value != before[key]})


def sdk1_catalog() -> Any:
    """A plugin catalog of this environment that allows only the sdk1 distribution."""
    from engine.core.plugins import Allowlist, PluginCatalog

    return PluginCatalog.discover(Allowlist.from_env(DIST))
