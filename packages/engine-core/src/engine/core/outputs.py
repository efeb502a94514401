"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sdk.errors import PluginFailure

#: One step's logprobs: token id -> Logprob, the sampled token first.
LogprobsStep = dict[int, "Logprob"]


@dataclass(frozen=True)
class Logprob:
    """The log-probability of one token at one position.

    Attributes:
        logprob: Natural-log probability under the model's raw distribution.
        rank: 1-based rank of the token in that distribution.
        decoded_token: The token's text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: Position among the request's ``n`` sequences.
        text: Generated text (stop strings removed).
        token_ids: Generated token ids.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"``, or None while
            running.
        stop_reason: The stop string or stop token id that ended it, if any.
        logprobs: Per generated token, when ``logprobs`` was requested.
        cumulative_logprob: Sum of the sampled tokens' logprobs, when requested.
        error: With ``finish_reason == "error"``: the plugin that failed while serving this
            sequence, and why (``error.message`` names it, its group and distribution).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[LogprobsStep] | None = None
    cumulative_logprob: float | None = None
    error: PluginFailure | None = None

    @property
    def finished(self) -> bool:
        """True once the sequence ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its ``n`` completions.

    Attributes:
        request_id: The request's id.
        prompt: The prompt text (None when given as token ids).
        prompt_token_ids: The tokenized prompt.
        prompt_logprobs: Per prompt token (None for the first), when requested.
        outputs: The completions, ordered by index.
        finished: True when every completion ended.
        num_cached_tokens: Prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[LogprobsStep | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0

    @property
    def error(self) -> PluginFailure | None:
        """The first sequence's plugin failure, if a plugin failed while serving any."""
        return next((c.error for c in self.outputs if c.error is not None), None)
