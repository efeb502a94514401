"""``LLM``: the offline API, shaped like vLLM's.

from engine.core import LLM, SamplingParams

llm = LLM()                                  # the built-in default model
outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
print(outputs[0].outputs[0].text)

llm = LLM(io_processor="my_processor")       # an engine.io_processors plugin
body = llm.encode({"my": "payload"})         # what POST /pooling would answer
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.core.config import EngineConfig
from engine.core.frontend.input_processor import PromptType
from engine.core.io_processing import generation_result, io_processor_missing
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
        log_stats: Log a line per finished request and a throughput line every 10 s (the
            built-in stat logger; off by default offline). ``engine.stat_loggers`` plugins
            are always used, and their ``shutdown()`` is called by :meth:`shutdown`.
        **kwargs: Any other :class:`~engine.core.config.EngineConfig` field
            (``max_num_seqs``, ``num_kv_blocks``, ``enable_prefix_caching``,
            ``io_processor``, ``custom_ops``, ...).

    Raises:
        pydantic.ValidationError: an option is invalid (the message names it).
        ValidationError: a plugin is misconfigured (unknown ``plugin_options`` name, a
            plugin class EngineCore's process cannot import, ...).
        EngineDeadError: EngineCore's process failed to start (with its error).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 in_process: bool = False, log_stats: bool = False, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.model_validate(
            {"model": model, "dtype": dtype, **kwargs}), in_process=in_process,
            log_stats=log_stats)
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop EngineCore (its process, if it has one), then the stat loggers; idempotent."""
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

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when no ``sampling_params`` are given.

        vLLM's defaults, with the model's ``generation_config.json`` values over them
        (the ``generation_config`` option: ``"vllm"`` leaves the file out).
        """
        return self.llm_engine.setup.generation_defaults.sampling_params()

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
        params = sampling_params or self.get_default_sampling_params()
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
        processor = self.llm_engine.input_processor
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = processor.tokenizer.apply_chat_template(conversation, add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": list(processor.encode_text(
                text, add_special_tokens=False, param="messages"))})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def encode(self, data: Any, sampling_params: SamplingParams | None = None, *,
               use_tqdm: bool = False) -> Any:
        """Run one payload through the IO processor, offline: what ``POST /pooling`` answers.

        The engine must have been created with ``io_processor=NAME`` (an
        ``engine.io_processors`` entry or ``module:Class``; ``--io-processor`` on the
        command line). ``data`` goes through the processor's ``parse_request`` and
        ``pre_process``; every prompt it makes is generated (with the prompt's own
        ``sampling_params``, else ``sampling_params``, else vLLM's defaults), and the
        finished generations, in prompt order, go through ``post_process``, whose return
        value is returned. vLLM names this ``LLM.encode`` too.

        Raises:
            ValidationError: no IO processor was selected (the message says how to select
                one); the processor refused the payload (its message and ``param``); or
                the engine refused a prompt it made (too long, ...). Nothing was queued.
            PluginError: the processor raised anything else, or broke its contract (no
                prompts, ``n != 1``), naming the plugin and its distribution.
        """
        engine = self.llm_engine
        handle = engine.io_processor
        if handle is None:
            raise ValidationError(io_processor_missing(
                engine.setup, "create the engine with LLM(..., io_processor=NAME) (engine "
                "serve --io-processor NAME)"), param="io_processor")
        request_id = f"encode-{next(self._ids)}"
        prompts = handle.pre_process(handle.parse_request(data), request_id,
                                     sampling_params or self.get_default_sampling_params())
        processed = []
        for prompt in prompts:
            try:
                processed.append(engine.process_request(prompt.request_id, prompt.prompt,
                                                        prompt.params))
            except ValidationError as exc:
                raise handle.invalid_prompt(prompt, exc) from exc
        outputs = engine.add_processed_requests(processed)
        self._run(len(outputs), use_tqdm)
        return handle.post_process(
            [generation_result(p.request_id, o) for p, o in zip(prompts, outputs, strict=True)],
            request_id)

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
