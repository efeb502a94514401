"""``engine serve --kv-connector offload --kv-connector-option path=DIR``, twice on one DIR.

The first server computes the prompt and saves its full blocks; a second server, a new
process started on the same directory, reports them as cached prompt tokens on its very
first request (``engine:external_prefix_cache_hits_total``; ``engine:prefix_cache_hits_total``
counts its own prefix cache, still empty) and answers with the same greedy text.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx

from engine.testing.server import RemoteServer, running_server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # 135 byte tokens: 8 full blocks


def counters(server: RemoteServer, *names: str) -> tuple[float, ...]:
    text = httpx.get(server.url_for("metrics"), timeout=10).text
    values = []
    for name in names:
        match = re.search(rf"^engine:{name}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        assert match is not None, text[-2000:]
        values.append(float(match.group(1)))
    return tuple(values)


HITS = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
        "external_prefix_cache_hits")


def complete(server: RemoteServer) -> str:
    result = server.client().completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True})
    return result.choices[0].text


def test_a_second_server_reports_the_first_ones_prompt_as_cached(
        tiny_llama_checkpoint: Path, tmp_path: Path) -> None:
    env = dict(os.environ, ENGINE_PLUGINS="none")
    args = ["--kv-connector", "offload", "--kv-connector-option", f"path={tmp_path}"]
    with running_server(tiny_llama_checkpoint, args, env=env) as first:
        text = complete(first)
        # 135 prompt tokens looked up locally, none found; all asked of the connector.
        assert counters(first, *HITS) == (135, 0, 135, 0)
    assert len(list(tmp_path.glob("*/rank0/*/*.kv"))) == 8
    with running_server(tiny_llama_checkpoint, args, env=env) as second:
        assert complete(second) == text
        # Its first request: 8 blocks from the directory, each counted once.
        assert counters(second, *HITS) == (135, 0, 135, 8 * 16)
