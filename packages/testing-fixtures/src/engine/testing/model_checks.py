"""A causal LM against ``transformers``, end to end, on a tiny checkpoint: one set of checks.

Every built-in model's tests (and a model plugin's) run the same scenarios: the prompt's
logits equal transformers' within tolerance and the greedy tokens equal, alone and with
chunked prefill, prefix-cache hits and preemption, every KV block free after each; two
tensor-parallel ranks on the ``mp`` executor give one rank's tokens; bfloat16 on the
default CPU path is a step graph whose tokens equal the eager pass's. ``ModelChecks``
runs each one::

    checks = ModelChecks(tiny_checkpoint, MyModelForCausalLM)
    checks.logits_and_greedy_tokens()
    for name in SCENARIOS:  # or one parametrized test each
        getattr(checks, name)()

The engines are in-process, float32, blocks of 4 tokens, no plugins but the engine's own
(``ModelChecks.options``; each check adds what it needs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.testing.engine import assert_kv_pool_full, hf_greedy, tokens_and_cached
from engine.testing.tensor_parallel import capture_logits

#: The checks after ``logits_and_greedy_tokens``, by method name, for one parametrized
#: test (``getattr(checks, name)()``).
SCENARIOS = ("chunked_prefill", "prefix_cache", "preemption", "two_ranks",
             "bfloat16_step_graph")
#: Prompts of 1 to 34 tokens: one past several blocks (and past a small sliding window).
PROMPTS = [[5, 9, 33, 7], list(range(40, 77)), [300], list(range(100, 117)) * 2]


def _default_options() -> dict[str, Any]:
    return {"dtype": "float32", "block_size": 4, "num_kv_blocks": 128, "in_process": True,
            "plugins": "none"}


@dataclass
class ModelChecks:
    """The scenarios for one checkpoint served by ``model_cls`` (module docstring).

    Attributes:
        checkpoint: A tiny random checkpoint ``transformers`` loads.
        model_cls: The engine class that must serve it.
        prompts: Token-id prompts (``PROMPTS``).
        max_tokens: New tokens per prompt, greedy, EOS ignored.
        options: ``LLM`` keyword arguments every engine of these checks gets.
    """

    checkpoint: Path
    model_cls: type
    prompts: Sequence[Sequence[int]] = field(default_factory=lambda: PROMPTS)
    max_tokens: int = 16
    options: dict[str, Any] = field(default_factory=_default_options)

    @property
    def by_path(self) -> str:
        """``--model-impl`` naming the class itself (what spawned workers resolve too)."""
        return f"{self.model_cls.__module__}:{self.model_cls.__qualname__}"

    @functools.cached_property
    def hf_tokens(self) -> list[list[int]]:
        """Transformers' greedy continuations of ``prompts``."""
        return hf_greedy(self.checkpoint, self.prompts, self.max_tokens)

    def llm(self, **kwargs: Any) -> Any:
        """An engine on the checkpoint with ``options`` and ``kwargs``."""
        from engine.core import LLM

        return LLM(str(self.checkpoint), **{**self.options, **kwargs})

    def run(self, llm: Any, prompts: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """Greedy tokens of ``prompts`` (default: all); every KV block is free afterwards."""
        tokens, _ = tokens_and_cached(llm, self.prompts if prompts is None else prompts,
                                      self._greedy())
        assert_kv_pool_full(llm)
        return tokens

    def model_of(self, llm: Any) -> Any:
        """The model the engine's (in-process) worker runs."""
        return llm.llm_engine.core.worker.model_runner.model

    def logits_and_greedy_tokens(self, atol: float = 1e-4) -> Any:
        """Prompt logits within ``atol`` of transformers', greedy tokens equal; the model.

        The logits are those of ``prompts[1]``; the checkpoint's must not be flat (greedy
        choices that are no ties).
        """
        from transformers import AutoModelForCausalLM

        from engine.core import SamplingParams

        prompt = list(self.prompts[1])
        with self.llm() as llm:
            model = self.model_of(llm)
            assert type(model) is self.model_cls, type(model)
            captured = capture_logits(model)
            llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)
            # One step: the rows predicting prompt tokens 1.., then the last (sampled) row.
            logits = torch.cat(sorted(captured, key=lambda t: -t.shape[0]))
            assert self.run(llm) == self.hf_tokens
        hf = AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=torch.float32).eval()
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert logits.shape == expected.shape
        # float32 throughout; differences are summation order only.
        torch.testing.assert_close(logits, expected, atol=atol, rtol=atol)
        assert expected.std(-1).min() > 0.5  # logits that are not flat: greedy is no tie
        assert len({tuple(t) for t in self.hf_tokens}) == len(self.hf_tokens)
        return model

    def chunked_prefill(self) -> None:
        """Prompts split into steps of 8 tokens give transformers' tokens."""
        with self.llm(max_num_batched_tokens=8, max_num_seqs=4) as llm:
            assert self.run(llm) == self.hf_tokens

    def prefix_cache(self) -> None:
        """A second prompt sharing 6 blocks reuses them and gives transformers' tokens."""
        shared = list(range(200, 224))  # 6 full blocks of 4
        prompts = [[*shared, 7, 8, 9], [*shared, 11, 12]]
        expected = hf_greedy(self.checkpoint, prompts, self.max_tokens)
        with self.llm() as llm:
            first, cached = tokens_and_cached(llm, prompts[:1], self._greedy())
            second, hits = tokens_and_cached(llm, prompts[1:], self._greedy())
            assert cached == [0] and hits == [len(shared)]
            assert first + second == expected
            assert_kv_pool_full(llm)

    def preemption(self) -> None:
        """Preempted and resumed requests give transformers' tokens.

        16 blocks of 4 tokens cannot hold every sequence at once.
        """
        with self.llm(num_kv_blocks=16, max_model_len=64) as llm:
            scheduler = llm.llm_engine.core.scheduler
            original = scheduler.schedule
            preempted = 0

            def counting_schedule() -> Any:
                nonlocal preempted
                out = original()
                preempted += len(out.preempted_req_ids)
                return out

            scheduler.schedule = counting_schedule
            assert self.run(llm) == self.hf_tokens
            assert preempted > 0

    def two_ranks(self) -> None:
        """Two tensor-parallel ranks on ``mp`` give transformers' (one rank's) tokens.

        The class is named by path: the spawned ranks discover entries from installed
        metadata themselves.
        """
        with self.llm(tensor_parallel_size=2, model_impl=self.by_path,
                      max_num_batched_tokens=16) as tp2:
            assert tp2.llm_engine.core.executor.backend == "mp"
            assert self.run(tp2) == self.hf_tokens

    def bfloat16_step_graph(self) -> None:
        """bfloat16 on the default CPU path: a step graph, the eager pass's tokens.

        Their first tokens still follow float32 transformers. Skipped (``pytest.skip``)
        where engine-kernels has no packed bfloat16 product.
        """
        import pytest

        from engine.kernels.cpu.native import native_kernels

        native = native_kernels()
        if native is None or torch.bfloat16 not in native.packed_matmul_dtypes:
            pytest.skip("no packed bfloat16 product in this build: the model runs eagerly")
        options = {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 32,
                   "max_num_batched_tokens": 64}
        with self.llm(**options) as llm:
            runner = llm.llm_engine.core.worker.model_runner
            assert type(runner.model) is self.model_cls
            assert runner.step_graph is not None
            graph_tokens = self.run(llm)
        with self.llm(enforce_eager=True, **options) as llm:
            assert self.run(llm) == graph_tokens
        assert [t[:2] for t in graph_tokens] == [t[:2] for t in self.hf_tokens]

    def bfloat16_logits(self, atol: float) -> Any:
        """bfloat16 (graph or eager): prompt logits within ``atol`` of transformers' bfloat16.

        For a model that may not be recorded as a step graph (``bfloat16_step_graph``
        needs one); the logits are those of ``prompts[1]``, and the first two greedy
        tokens of every prompt still follow float32 transformers. Returns the engine's
        model runner (its ``step_graph``: whether the pass was recorded).
        """
        from transformers import AutoModelForCausalLM

        from engine.core import SamplingParams

        prompt = list(self.prompts[1])
        options = {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 32,
                   "max_num_batched_tokens": 64}
        with self.llm(**options) as llm:
            runner = llm.llm_engine.core.worker.model_runner
            assert type(runner.model) is self.model_cls
            captured = capture_logits(runner.model)
            llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)
            logits = torch.cat(sorted(captured, key=lambda t: -t.shape[0]))
            tokens = self.run(llm)
        hf = AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=torch.bfloat16).eval()
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0.0)
        assert [t[:2] for t in tokens] == [t[:2] for t in self.hf_tokens]
        return runner

    def _greedy(self) -> Any:
        from engine.core import SamplingParams

        return SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)


__all__ = ["PROMPTS", "SCENARIOS", "ModelChecks"]
