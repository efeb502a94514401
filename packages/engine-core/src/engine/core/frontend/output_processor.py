"""Turn EngineCore outputs into ``RequestOutput``s: text, stop strings, logprobs, n > 1.

Per choice (one engine request each), tokens are detokenized incrementally and the text
goes through the stop-string checker, which never lets part of a stop string out. A
choice ended by a stop string must also end in EngineCore: its id is returned in
``ProcessedOutputs.reqs_to_abort``. A request is finished when all its choices are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.frontend.input_processor import ProcessedRequest
from engine.core.outputs import CompletionOutput, Logprob, LogprobsStep, RequestOutput
from engine.core.tokenizer.detokenizer import IncrementalDetokenizer
from engine.core.tokenizer.stop_strings import StopStringChecker
from engine.core.tokenizer.tokenizer import Tokenizer
from engine.sdk.scheduler import EngineCoreOutput, SampleLogprobs


@dataclass
class _Choice:
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    stop_checker: StopStringChecker | None


@dataclass
class _Request:
    output: RequestOutput
    choices: dict[str, _Choice]
    num_unfinished: int
    want_prompt_logprobs: bool


@dataclass
class ProcessedOutputs:
    """Result of one batch of engine outputs."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Holds the front-end state of every request in flight."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(self, request: ProcessedRequest) -> RequestOutput:
        """Start tracking a validated request; returns its (empty) output object."""
        params = request.params
        output = RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids), outputs=[],
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        choices = {}
        for index, child in enumerate(request.children):
            completion = CompletionOutput(
                index=index, logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            output.outputs.append(completion)
            choices[child.request_id] = _Choice(
                completion=completion,
                detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                   params.skip_special_tokens),
                stop_checker=StopStringChecker(params.stop, params.include_stop_str_in_output)
                if params.stop else None,
            )
            self._child_to_parent[child.request_id] = request.request_id
        self._requests[request.request_id] = _Request(
            output, choices, len(choices), params.prompt_logprobs is not None)
        return output

    def has_unfinished_requests(self) -> bool:
        """True while some request is tracked."""
        return bool(self._requests)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request (finish its choices with ``abort``); returns its engine ids."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        for child_id, choice in state.choices.items():
            self._child_to_parent.pop(child_id, None)
            if choice.completion.finish_reason is None:
                choice.completion.finish_reason = "abort"
        state.output.finished = True
        return list(state.choices)

    def process_outputs(self, outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's outputs; returns the touched requests and ids to abort."""
        result = ProcessedOutputs()
        touched: dict[str, RequestOutput] = {}
        for out in outputs:
            parent_id = self._child_to_parent.get(out.request_id)
            if parent_id is None:
                continue  # aborted meanwhile
            state = self._requests[parent_id]
            choice = state.choices[out.request_id]
            if choice.completion.finish_reason is not None:
                continue
            if out.new_prompt_logprobs is not None and state.output.prompt_logprobs is not None:
                state.output.prompt_logprobs.extend(self._logprob_steps(out.new_prompt_logprobs))
            if out.num_cached_tokens:
                state.output.num_cached_tokens = out.num_cached_tokens
            if self._apply(choice, out):
                result.reqs_to_abort.append(out.request_id)
            if choice.completion.finish_reason is not None:
                state.num_unfinished -= 1
                self._child_to_parent.pop(out.request_id, None)
            touched[parent_id] = state.output
            if state.num_unfinished == 0:
                state.output.finished = True
                del self._requests[parent_id]
        result.request_outputs = list(touched.values())
        return result

    def _apply(self, choice: _Choice, out: EngineCoreOutput) -> bool:
        """Add a step's tokens to a choice; True when a stop string ended it early."""
        completion = choice.completion
        completion.token_ids.extend(out.new_token_ids)
        if completion.logprobs is not None and out.new_logprobs is not None:
            steps = self._logprob_steps(out.new_logprobs)
            completion.logprobs.extend(steps)
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                next(iter(step.values())).logprob for step in steps)
        delta = choice.detokenizer.step(out.new_token_ids)
        if out.finished:
            delta += choice.detokenizer.flush()
        if choice.stop_checker is None:
            completion.text += delta
        else:
            check = choice.stop_checker.append(delta)
            completion.text += check.text
            if check.is_stopped:
                completion.finish_reason = "stop"
                completion.stop_reason = check.stop_str
                return not out.finished
            if out.finished:
                completion.text += choice.stop_checker.flush()
        if out.finished:
            completion.finish_reason = out.finish_reason
            completion.stop_reason = out.stop_reason
            completion.error = out.error
        return False

    def _logprob_steps(self, logprobs: SampleLogprobs) -> list[LogprobsStep]:
        steps = []
        for ids, lps, rank in zip(logprobs.token_ids, logprobs.logprobs,
                                  logprobs.sampled_token_ranks, strict=True):
            if not ids:
                continue
            step = {ids[0]: Logprob(lps[0], rank, self._decode(ids[0]))}
            for position, (token, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
                step.setdefault(token, Logprob(lp, position, self._decode(token)))
            steps.append(step)
        return steps

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
