"""``engine kernels list|clear``: the measured kernel choices kept on this machine."""

from __future__ import annotations

import json

import pytest

from engine.core.kernel_choice import store
from engine.core.kernel_choice.buckets import row_buckets
from engine.core.kernel_choice.plan import choose
from engine.core.kernel_choice.timing import Timing
from engine.server.cli._main import main


@pytest.fixture
def kept(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    timings = [Timing("onednn", (2e-5, 1e-4), (1.0, 1.0), True),
               Timing("cpu", (1e-5, 3e-4), (1.1, 1.0), True)]
    plan = choose(timings, row_buckets(3), ["cpu", "onednn"])
    key = {"cpu": "Some CPU", "threads": 2,
           "config": {"scheme": "unquantized", "weight_dtype": "bfloat16",
                      "input_size": 768, "output_size": 1280, "has_bias": False}}
    return store.save(key, plan)


def test_list_shows_each_kept_choice_with_its_times(kept, capsys):
    assert main(["kernels", "list"]) == 0
    out = capsys.readouterr().out
    assert str(store.choices_dir()) in out
    assert "unquantized bfloat16 [768 -> 1280], 2 threads, Some CPU, measured" in out
    assert "cpu for 1 row (10.0 µs; onednn 20.0); onednn for 2+ rows (100.0 µs; cpu 300.0)" in out
    assert main(["kernels", "list", "--json"]) == 0
    [record] = json.loads(capsys.readouterr().out)
    assert record["plan"]["kernels"] == ["cpu", "onednn"] and record["path"] == str(kept.path)


def test_clear_removes_them_and_list_says_where_they_would_be(kept, capsys):
    assert main(["kernels", "clear"]) == 0
    assert "removed 1 kernel choice(s)" in capsys.readouterr().out
    assert main(["kernels", "list"]) == 0
    assert "no kernel choices kept in" in capsys.readouterr().out
    assert not kept.path.exists()


def test_list_shows_attention_and_custom_op_choices_by_what_they_serve(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    timings = [Timing("cpu", (1e-4, 2e-3), (1.0, 1.0), False),
               Timing("torch", (4e-4, 1e-3), (1.0, 1.0), False)]
    key = {"what": "attention", "cpu": "Some CPU", "threads": 2,
           "spec": {"num_heads": 12, "num_kv_heads": 4, "head_size": 64,
                    "dtype": "bfloat16"}}
    store.save(key, choose(timings, row_buckets(3), ["cpu", "torch"]))
    op_key = {"what": "custom_op", "op": "rms_norm", "cpu": "Some CPU", "threads": 2,
              "shape": {"hidden_size": 768, "dtype": "bfloat16"}}
    store.save(op_key, choose(timings, row_buckets(3), ["cpu", "torch"]))
    assert main(["kernels", "list"]) == 0
    out = capsys.readouterr().out
    assert "- custom op rms_norm hidden=768 bfloat16, 2 threads, Some CPU, measured" in out
    assert "attention heads=12/4 head_size=64 bfloat16, 2 threads, Some CPU, measured" in out
    assert "cpu for 1 row (100.0 µs; torch 400.0); cpu for 2+ rows (2000.0 µs; torch " in out
