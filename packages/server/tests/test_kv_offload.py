"""``engine serve --kv-connector offload --kv-connector-option path=DIR``, twice on one DIR.

The first server computes the prompt and saves its full blocks; a second server, a new
process started on the same directory, reports them as cached prompt tokens on its very
first request (``engine:prefix_cache_hits_total``: its own prefix cache is still empty)
and answers with the same greedy text.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx

from engine.testing.server import RemoteServer, running_server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # 135 byte tokens: 8 full blocks


def prefix_cache_hits(server: RemoteServer) -> float:
    text = httpx.get(server.url_for("metrics"), timeout=10).text
    match = re.search(r"^engine:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match is not None, text[-2000:]
    return float(match.group(1))


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
        assert prefix_cache_hits(first) == 0
    assert len(list(tmp_path.glob("*/rank0/*/*.kv"))) == 8
    with running_server(tiny_llama_checkpoint, args, env=env) as second:
        assert complete(second) == text
        assert prefix_cache_hits(second) == 8 * 16  # its first request, from the directory
