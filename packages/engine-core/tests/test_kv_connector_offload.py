"""The built-in ``offload`` connector through whole engines on the tiny checkpoint.

A second engine started on the same directory gets the first one's prompt blocks as
cached tokens with greedy tokens equal to a run without the connector; engines that could
not use those blocks (other dtype, block size, tensor-parallel size, namespace) never load
them; the CPU-memory store serves a second tier within one engine; tensor-parallel ranks
keep their own shares. Every scenario ends with every KV block free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM, SamplingParams
from engine.sdk import PluginError
from engine.testing.engine import assert_kv_pool_full, tokens_and_cached

#: A prompt of three full 16-token blocks and a bit, one of two blocks, one of one block.
PROMPTS = (list(range(10, 60)), [*range(10, 40), 3, 4, 5], [7] * 20, [9, 8, 7])
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
#: Prompt tokens of PROMPTS in full 16-token blocks (what a store can hold).
STORED = [48, 32, 16, 0]


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "plugins": "none", "num_kv_blocks": 64,
                               "in_process": True}
    options.update(kwargs)
    return LLM(str(path), **options)


def offload(directory: Path | None = None, **options: Any) -> dict[str, Any]:
    if directory is not None:
        options["path"] = str(directory)
    return {"kv_connector": "offload", "kv_connector_options": options}


def generate(llm: LLM, prompts: Sequence[Sequence[int]] = PROMPTS,
             ) -> tuple[list[list[int]], list[int]]:
    return tokens_and_cached(llm, prompts, GREEDY)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    with make_llm(tiny_llama) as llm:
        tokens, cached = generate(llm)
        assert cached == [0, 16, 0, 0]  # the second prompt shares a block with the first
        return tokens


def test_a_second_engine_on_the_directory_starts_with_the_first_ones_blocks(
        tiny_llama: Path, tmp_path: Path, reference: list[list[int]]) -> None:
    with make_llm(tiny_llama, **offload(tmp_path)) as llm:
        assert generate(llm) == (reference, [0, 16, 0, 0])
        assert_kv_pool_full(llm)
    [namespace] = [p for p in tmp_path.iterdir() if p.is_dir()]
    files = sorted((namespace / "rank0").rglob("*.kv"))
    assert len(files) == 48 // 16 + 1 + 1  # 3 + (the second prompt's own block) + 1
    fields = json.loads((namespace / "namespace.json").read_text())
    assert fields["kv_cache_dtype"] == "float32" and fields["block_size"] == 16
    with make_llm(tiny_llama, **offload(tmp_path)) as llm:
        assert generate(llm) == (reference, STORED)
        assert_kv_pool_full(llm)
    with make_llm(tiny_llama, **offload(tmp_path, load_async=True)) as llm:
        assert generate(llm) == (reference, STORED)
        assert_kv_pool_full(llm)
    assert sorted((namespace / "rank0").rglob("*.kv")) == files  # nothing saved twice


def test_engines_that_cannot_use_the_blocks_never_load_them(
        tiny_llama: Path, tmp_path: Path) -> None:
    with make_llm(tiny_llama, **offload(tmp_path)) as llm:
        generate(llm)
    for changes in ({"dtype": "bfloat16"}, {"block_size": 8},
                    offload(tmp_path, namespace="other")):
        with make_llm(tiny_llama, **{**offload(tmp_path), **changes}) as llm:
            _, cached = generate(llm, PROMPTS[:1])
            assert cached == [0], changes
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 4


def test_a_directory_written_in_another_layout_is_refused(
        tiny_llama: Path, tmp_path: Path) -> None:
    with make_llm(tiny_llama, **offload(tmp_path)) as llm:
        generate(llm, PROMPTS[:1])
    [layout] = tmp_path.glob("*/rank0/layout.json")
    layout.write_text(json.dumps({**json.loads(layout.read_text()), "block_dim": 0}))
    with pytest.raises(PluginError, match="'offload'.*register_kv_caches raised ValueError: "
                                          "offload: .* holds blocks in layout"):
        make_llm(tiny_llama, **offload(tmp_path))


def test_cpu_memory_is_a_second_tier_behind_the_prefix_cache(
        tiny_llama: Path, reference: list[list[int]]) -> None:
    with make_llm(tiny_llama, **offload()) as llm:
        assert generate(llm) == (reference, [0, 16, 0, 0])
        assert llm.llm_engine.core.reset_prefix_cache()
        assert generate(llm) == (reference, STORED)  # from CPU memory, not the cache
        assert_kv_pool_full(llm)
    with make_llm(tiny_llama, **offload(cpu_memory_gib=1e-9)) as llm:  # room for one block
        generate(llm)
        assert llm.llm_engine.core.reset_prefix_cache()
        tokens, cached = generate(llm)
        assert tokens == reference and cached[0] == 0  # its first block was evicted
        assert_kv_pool_full(llm)


def test_invalid_options_name_the_connector(tiny_llama: Path) -> None:
    with pytest.raises(PluginError, match="plugin 'offload' .*invalid --kv-connector-option"):
        make_llm(tiny_llama, **offload(bogus=1))
    with pytest.raises(PluginError, match="no plugin named 'nope' in group "
                                          "engine.kv_connectors. Available: .*offload"):
        make_llm(tiny_llama, kv_connector="nope")


def test_tensor_parallel_ranks_keep_their_own_shares(
        tiny_llama: Path, tmp_path: Path, reference: list[list[int]]) -> None:
    # Two worker processes (mp): the metadata crosses gRPC as bytes, each rank saves and
    # loads its own heads, and an asynchronous load is reported once both ranks have it.
    with make_llm(tiny_llama, tensor_parallel_size=2,
                  **offload(tmp_path, load_async=True)) as llm:
        assert generate(llm) == (reference, [0, 16, 0, 0])
        assert llm.llm_engine.core.reset_prefix_cache()
        assert generate(llm) == (reference, STORED)
        assert_kv_pool_full(llm)
    [namespace] = [p for p in tmp_path.iterdir() if p.is_dir()]
    rank0, rank1 = (sorted(p.name for p in (namespace / f"rank{r}").rglob("*.kv"))
                    for r in (0, 1))
    assert rank0 == rank1 and len(rank0) == 5
    with make_llm(tiny_llama, **offload(tmp_path)) as llm:  # one rank: another namespace
        assert generate(llm, PROMPTS[:1])[1] == [0]
