"""``LLM``: the offline API, shaped like vLLM's.

from engine.core import LLM, SamplingParams

llm = LLM()                                  # the built-in default model
outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.core.config import EngineConfig
from engine.core.frontend.input_processor import PromptType
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.tokenizer import Tokenizer
from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams

Messages = Sequence[Mapping[str, Any]]


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, (str, Mapping)):
        return True
    return isinstance(prompts, Sequence) and bool(prompts) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts)


class LLM:
    """An engine for offline batch generation.

    EngineCore (scheduler, KV cache, model) runs in its own spawned process behind gRPC,
    as under ``engine serve``; ``in_process=True`` runs it in this process with direct
    calls instead (debugging, tests that inspect the model). Both give the same tokens.
    :meth:`shutdown` (or ``with LLM(...) as llm:``) stops it; so do garbage collection and
    interpreter exit.

    Args:
        model: A Hugging Face directory or a ``.gguf`` file; None for the built-in default.
        dtype: ``auto``, ``bfloat16``, ``float16`` or ``float32``.
        in_process: Run EngineCore in this process instead of its own.
        **kwargs: Any other :class:`~engine.core.config.EngineConfig` field
            (``max_num_seqs``, ``num_kv_blocks``, ``enable_prefix_caching``, ...).

    Raises:
        pydantic.ValidationError: an option is invalid (the message names it).
        ValidationError: a plugin is misconfigured (unknown ``plugin_options`` name, a
            plugin class EngineCore's process cannot import, ...).
        EngineDeadError: EngineCore's process failed to start (with its error).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 in_process: bool = False, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.model_validate(
            {"model": model, "dtype": dtype, **kwargs}), in_process=in_process)
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop EngineCore (its process, if it has one); idempotent."""
        self.llm_engine.shutdown()

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call ``method`` of the worker extensions on every worker (vLLM's collective_rpc).

        ``method`` is a method of a worker extension selected with
        ``worker_extensions=[...]`` (``--worker-extension``); inside it ``self`` is the
        worker (``rank``, ``world_size``, ``device``, ``model``, ``kv_caches``). Returns one
        result per tensor-parallel rank, in rank order. Arguments and results must be
        JSON-serialisable unless ``in_process=True`` with one rank.

        Raises:
            CollectiveRpcError: no selected extension defines ``method``, the method raised
                on a rank (the message names the rank, the extension and its
                distribution), or no answer came within ``timeout`` seconds. The engine
                keeps serving.
            EngineDeadError: the engine is gone.
        """
        return self.llm_engine.collective_rpc(method, args, kwargs, timeout)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.llm_engine.tokenizer

    def generate(
        self, prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
        use_tqdm: bool = True, priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``.
        ``sampling_params`` is one for all prompts or one per prompt (default: vLLM's
        defaults, 16 tokens).

        Raises:
            ValidationError: a prompt or parameter is invalid; nothing was queued.
        """
        items: list[PromptType] = (
            [prompts] if _is_single_prompt(prompts)  # type: ignore[list-item]
            else list(prompts)  # type: ignore[arg-type]
        )
        params = sampling_params or SamplingParams()
        params_list = [params] * len(items) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(items):
            raise ValidationError(f"got {len(params_list)} sampling params for {len(items)} "
                                  f"prompts; pass one, or one per prompt",
                                  param="sampling_params")
        priorities = list(priority) if priority is not None else [0] * len(items)
        engine = self.llm_engine
        processed = [
            engine.process_request(str(next(self._ids)), prompt, p, priority=prio)
            for prompt, p, prio in zip(items, params_list, priorities, strict=True)
        ]
        outputs = engine.add_processed_requests(processed)
        self._run(len(outputs), use_tqdm)
        return outputs

    def chat(
        self, messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
        use_tqdm: bool = True, add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied)."""
        conversations: list[Messages] = (
            [messages] if messages and isinstance(messages[0], Mapping)  # type: ignore[list-item]
            else list(messages))  # type: ignore[arg-type]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids":
                            tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, total: int, use_tqdm: bool) -> None:
        engine = self.llm_engine
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        bar.update(1)
        finally:
            bar.close()
