"""``--enable-log-requests``: one INFO line per generation request, as vLLM logs them.

Off by default (vLLM's default too; ``--disable-log-requests`` is accepted and keeps it
off). When on, every ``/v1/completions`` and ``/v1/chat/completions`` request logs its id,
its prompt (text and/or token ids, cut to ``--max-log-len`` characters and ids) and its
sampling parameters on the ``engine.server.requests`` logger, before it is queued::

    INFO engine.server.requests: Received request cmpl-3f2a...-0: prompt: 'Hello', params:
    SamplingParams(n=1, temperature=0.7, ...)

The line is written at INFO, so ``--log-level WARNING`` hides it as well.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from engine.sdk.sampling_params import SamplingParams
from engine.server.state import ServerArgs

logger = logging.getLogger("engine.server.requests")


def _cut(value: Any, max_len: int | None) -> Any:
    if max_len is None or not isinstance(value, (str, list, tuple)):
        return value
    return value[:max_len]


def describe_prompt(prompt: Any, max_len: int | None = None) -> str:
    """``prompt: '...'`` and/or ``prompt_token_ids: [...]`` of one prompt, cut to ``max_len``."""
    if isinstance(prompt, Mapping):
        parts = []
        if prompt.get("prompt") is not None:
            parts.append(f"prompt: {_cut(prompt['prompt'], max_len)!r}")
        if prompt.get("prompt_token_ids") is not None:
            parts.append(f"prompt_token_ids: {list(_cut(prompt['prompt_token_ids'], max_len))}")
        return ", ".join(parts)
    if isinstance(prompt, str):
        return f"prompt: {_cut(prompt, max_len)!r}"
    return f"prompt_token_ids: {list(_cut(list(prompt), max_len))}"


def log_request(args: ServerArgs, request_id: str, prompts: Any,
                params: SamplingParams) -> None:
    """Log ``request_id``'s prompt(s) and ``params`` when ``args.enable_log_requests``.

    Args:
        args: The server's options (``enable_log_requests``, ``max_log_len``).
        request_id: The response id the client sees.
        prompts: A prompt (text, token ids, or ``{"prompt", "prompt_token_ids"}``) or a
            list of prompts (a completions batch).
        params: The request's sampling parameters, defaults applied.
    """
    if not args.enable_log_requests or not logger.isEnabledFor(logging.INFO):
        return
    batch: Sequence[Any] = (
        prompts if isinstance(prompts, list) and prompts
        and not isinstance(prompts[0], int) else [prompts])
    for index, prompt in enumerate(batch):  # the engine's request ids (start_requests)
        logger.info("Received request %s-%d: %s, params: %s", request_id, index,
                    describe_prompt(prompt, args.max_log_len), params)
