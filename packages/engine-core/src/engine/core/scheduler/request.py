"""``Request``: the scheduler's mutable record of one sequence.

It satisfies the SDK's read-only :class:`~engine.sdk.scheduler.RequestView` (what
policies and connectors see) and the KV-cache manager's ``KVCacheRequest``.

Stop conditions, checked by :meth:`Request.append_output_token` after each sampled token,
in this order (the first that holds ends the request):

1. EOS: the token is ``eos_token_id``, ``ignore_eos`` is off -> ``FINISHED_STOPPED``;
2. stop ids: the token is in ``stop_token_ids`` -> ``FINISHED_STOPPED``, ``stop_reason``
   is the token;
3. length: ``max_tokens`` outputs, or ``max_model_len`` tokens in all ->
   ``FINISHED_LENGTH_CAPPED``.

1 and 2 only apply once ``min_tokens`` tokens precede the new one (the sampler suppresses
EOS and stop ids until then). The stopping token stays in the output, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.kv_cache import BlockHash
from engine.sdk.scheduler import EngineRequest, RequestStatus


class Request:
    """One sequence inside the scheduler (engine-internal; plugins see it as a RequestView).

    Args:
        engine_request: The request as the front end sent it.
        max_model_len: Longest sequence (prompt + output) the model serves.
        seq: Insertion order, the tie-breaker after the policy's sort key.

    Attributes:
        status: Where the request is in its life.
        num_computed_tokens: Tokens whose KV is in the cache (advanced when scheduled).
        num_cached_tokens: Prompt tokens served from the prefix cache at first admission.
        num_preemptions: How often the request was preempted.
        stop_reason: The stop token id that ended the request, if any.
        block_hashes: Hashes of its leading full blocks (filled by the KV-cache manager).
        max_output_tokens: Output length at which the request is length-capped.
    """

    def __init__(self, engine_request: EngineRequest, max_model_len: int, seq: int = 0) -> None:
        params = engine_request.sampling_params
        self.request_id = engine_request.request_id
        self.prompt_token_ids = engine_request.prompt_token_ids
        self.sampling_params = params
        self.eos_token_id = engine_request.eos_token_id
        self.arrival_time = engine_request.arrival_time
        self.priority = engine_request.priority
        self.seq = seq
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | None = None
        self.block_hashes: list[BlockHash] = []
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        num_prompt_tokens = len(self.prompt_token_ids)
        self.max_output_tokens = max_model_len - num_prompt_tokens
        if params.max_tokens is not None:
            self.max_output_tokens = min(self.max_output_tokens, params.max_tokens)
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._stops_on_eos = self.eos_token_id is not None and not params.ignore_eos

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Tokens generated so far (a live view: do not mutate)."""
        return self._output_token_ids

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by the output so far (a live view: do not mutate)."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self._output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self._all_token_ids)

    def append_output_token(self, token_id: int) -> bool:
        """Append one sampled token and apply the stop conditions (module header).

        Returns:
            True if the request finished with this token (``status`` is then final).
        """
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        num_output_tokens = len(self._output_token_ids)
        if num_output_tokens > self.sampling_params.min_tokens:
            if self._stops_on_eos and token_id == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in self._stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token_id
                return True
        if num_output_tokens >= self.max_output_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
