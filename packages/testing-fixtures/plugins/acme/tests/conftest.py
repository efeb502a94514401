"""Fixtures of acme-engine-plugins' tests (run them with ``pytest -p engine.testing``).

The engine runs in-process (``LLM(..., in_process=True)``) so that its workers and
EngineCore are this process: a spy put on a plugin class here sees the engine's calls.
"""

from __future__ import annotations

import inspect
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

#: Greedy, a fixed length, EOS ignored: comparable token for token.
MAX_TOKENS = 12


@pytest.fixture(scope="session", autouse=True)
def _offline(hub_offline: None) -> None:
    """No Hugging Face Hub access (engine.testing's ``hub_offline``)."""


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_checkpoint: Path) -> Path:
    """engine.testing's tiny random Llama checkpoint (byte-level tokenizer, chat template)."""
    return tiny_llama_checkpoint


def build_tiny_qwen3(path: Path, tokenizer_from: Path, **changes: Any) -> Path:
    """A tiny random Qwen3 checkpoint: GQA, ``head_dim`` 32 (not hidden / heads = 16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **changes})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # a wide spread keeps greedy choices apart; norms get weights too
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


@pytest.fixture(scope="session")
def qwen3_builder(tiny_llama: Path) -> Callable[..., Path]:
    """``qwen3_builder(path, **config_changes)``: a tiny Qwen3 checkpoint at ``path``."""
    return lambda path, **changes: build_tiny_qwen3(path, tiny_llama, **changes)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "qwen3", tiny_llama)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[type, str], Counter[str]]]:
    """``calls = spy(Cls, "method")``: counts calls of ``Cls.method`` in ``calls["method"]``.

    Works for plain methods, class methods and static methods; undone after the test.
    """
    calls: Counter[str] = Counter()

    def install(cls: type, name: str) -> Counter[str]:
        raw = inspect.getattr_static(cls, name)  # the classmethod/staticmethod object too
        if isinstance(raw, classmethod):
            func = raw.__func__

            def wrapped_cm(klass: type, *args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return func(klass, *args, **kwargs)

            monkeypatch.setattr(cls, name, classmethod(wrapped_cm))
        elif isinstance(raw, staticmethod):
            sfunc = raw.__func__

            def wrapped_sm(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return sfunc(*args, **kwargs)

            monkeypatch.setattr(cls, name, staticmethod(wrapped_sm))
        else:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return raw(*args, **kwargs)

            monkeypatch.setattr(cls, name, wrapped)
        return calls

    yield install


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
                  **params: Any) -> list[list[int]]:
    """The greedy continuations of token-id ``prompts``."""
    from engine.core import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=max_tokens,
                                          ignore_eos=True, **params), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="session")
def greedy() -> Callable[..., list[list[int]]]:
    """``greedy(llm, prompts, max_tokens=12, **sampling)``: greedy continuations."""
    return greedy_tokens


#: Prompts: short, longer than two 16-token blocks, and a repetitive one.
PROMPTS = [[5, 17, 99, 3, 42], list(range(30, 70)), [7] * 20]


@pytest.fixture
def prompts() -> list[list[int]]:
    return [list(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., Any]:
    """``make_llm(checkpoint, **kwargs)``: an in-process, float32 ``LLM`` with 64 KV blocks."""
    from engine.core import LLM

    def make(checkpoint: Path, **kwargs: Any) -> Any:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("num_kv_blocks", 64)
        return LLM(str(checkpoint), in_process=True, **kwargs)

    return make


@pytest.fixture(scope="session")
def qwen3_tokens(tiny_qwen3: Path, make_llm: Callable[..., Any],
                 greedy: Callable[..., list[list[int]]]) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS`` on the tiny Qwen3 with the engine's own ops and none of
    this package's optional plugins selected: the reference runs with plugins compare to."""
    with make_llm(tiny_qwen3, custom_ops=["none"]) as llm:
        return greedy(llm, [list(p) for p in PROMPTS])
