"""A third party's ``rms_norm`` installed beside engine-kernels': the engine starts and chooses.

``engine-test-plugin-ops`` registers ``rms_norm`` exactly as docs/plugins/custom-ops.md has
shown since SDK 1.0 (the entry named after the op), while engine-kernels (installed with
engine-server) registers the same name. Before, every engine stopped at start-up with
"2 distributions provide 'rms_norm'", even one that never replaced the op. Now both are
candidates: on the CPU the plugin's has a path of its own and engine-kernels' Triton op has
none, so the plugin's is used; the operator can force either, or the built-in, and the
tokens equal those of the contract's reference op.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.sdk import SamplingParams
from engine.testing.test_plugins import install_test_plugins, put_on_path, run_engine_cli

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def ops_plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_test_plugins(tmp_path_factory.mktemp("ops-plugin"), ("ops",))


@pytest.fixture
def ops_plugin(ops_plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The plugin installed and every plugin allowed (ENGINE_PLUGINS unset)."""
    yield put_on_path(ops_plugin_dir, monkeypatch)


def _run(checkpoint: Path, **kwargs: Any) -> tuple[list[list[int]], str]:
    with LLM(str(checkpoint), dtype="float32", in_process=True, num_kv_blocks=32,
             **kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                               use_tqdm=False)
        norm = type(llm.llm_engine.core.worker.built.model.norm)
        return [list(o.outputs[0].token_ids) for o in outputs], norm.__module__


def test_a_replacement_beside_engine_kernels_starts_and_is_used_on_the_cpu(
        ops_plugin: Path, tiny_llama: Path) -> None:
    from engine_test_plugin_ops import CALLS

    reference, module = _run(tiny_llama, custom_ops=["+rms_norm=engine.sdk.ops:RMSNormOp"])
    assert module == "engine.sdk.ops"  # the contract's reference op itself
    CALLS.clear()
    tokens, module = _run(tiny_llama)  # nothing selects the op: the default rule
    assert module == "engine_test_plugin_ops" and CALLS["rms_norm.forward_cpu"] > 0
    assert tokens == reference
    CALLS.clear()
    tokens, module = _run(tiny_llama, custom_ops=["+rms_norm=engine-kernels"])
    assert module == "engine.kernels.ops.replacements" and tokens == reference
    tokens, module = _run(tiny_llama, custom_ops=["-rms_norm"])
    assert module == "engine.core.model_executor.layers.builtin_ops" and tokens == reference
    assert CALLS["rms_norm.forward_cpu"] == 0


def test_plugins_list_shows_each_op_s_candidates_and_the_winner(ops_plugin_dir: Path) -> None:
    listed = run_engine_cli(["plugins", "list"], ops_plugin_dir)
    assert listed.returncode == 0, listed.stderr
    text = listed.stdout
    assert "CONFLICT" not in text
    block = text[text.index("custom ops"):]
    rms = block[block.index("  rms_norm"):block.index("  rotary_embedding")]
    assert ("rms_norm = engine_test_plugin_ops:FusedRMSNorm (engine-test-plugin-ops 0.1.0)"
            in rms)
    assert "* engine_test_plugin_ops:FusedRMSNorm (engine-test-plugin-ops 0.1.0)" in rms
    assert "engine.kernels.ops:RMSNorm (engine-kernels" in rms
    assert "not eligible: it has no cpu path of its own" in rms
    forced = run_engine_cli(["plugins", "list", "--custom-ops", "+rms_norm=engine-kernels"],
                            ops_plugin_dir)
    assert "rms_norm = engine.kernels.ops:RMSNorm" in forced.stdout, forced.stderr
