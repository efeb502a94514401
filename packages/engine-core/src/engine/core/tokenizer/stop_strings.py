r"""Stop strings over streamed text, with the same result however the text is chunked.

A request stops at the first stop string to *complete*: the match with the smallest end
position in the output text (ties: the earliest start, i.e. the longest). That is what a
token-by-token engine observes, and it makes the result independent of chunking: a match
ending inside an earlier chunk is found when that chunk arrives.

Streaming must never show part of a stop string. With ``include_stop_str_in_output=False``
the checker holds back the longest tail of the text that is a proper prefix of some stop
string (``"Hello\nUs"`` with stop ``"\nUser:"`` emits ``"Hello"`` and holds ``"\nUs"``),
releasing it once it can no longer start a stop string, or on :meth:`StopStringChecker.flush`
when generation ends for another reason. Matches are then searched only in the held-back
tail plus the new text: a stop string starting in already emitted text would have made that
text a stop-string prefix, which would have been held back.

With ``include_stop_str_in_output=True`` nothing is held back (text up to the end of the
match is emitted anyway), so a match may start in emitted text: the search also covers the
last ``max(len(stop)) - 1`` emitted characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.sdk.errors import ValidationError


@dataclass(frozen=True)
class StopCheckResult:
    """What :meth:`StopStringChecker.append` decided for one chunk of text.

    Attributes:
        text: The text to emit now (may be empty).
        is_stopped: A stop string completed; nothing more will be emitted.
        stop_str: The stop string that matched, if any.
    """

    text: str
    is_stopped: bool = False
    stop_str: str | None = None


class StopStringChecker:
    """Finds stop strings in a request's streamed output text.

    Args:
        stop: The stop strings (empty strings are rejected).
        include_stop_str_in_output: Emit the matched stop string itself too.

    Raises:
        ValidationError: A stop string is empty.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValidationError("stop strings must not be empty", param="stop")
        self.stop = tuple(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._pending = ""  # received, not emitted (held back)
        self._lookback = ""  # emitted, still searched (include_stop_str_in_output only)
        self._lookback_size = max((len(s) for s in self.stop), default=1) - 1
        self._stopped = False

    @property
    def is_stopped(self) -> bool:
        """Whether a stop string has matched."""
        return self._stopped

    def append(self, delta: str) -> StopCheckResult:
        """Feed the next chunk of output text.

        Args:
            delta: New output text (any length; the concatenation of all deltas is the
                output text).

        Returns:
            The text to emit and whether a stop string completed. After a stop, further
            calls return empty results.
        """
        if self._stopped:
            return StopCheckResult("", True, None)
        text = self._pending + delta
        lookback = len(self._lookback)
        match = self._earliest_match(self._lookback + text)
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            self._pending = self._lookback = ""
            self._stopped = True
            return StopCheckResult(text[: end - lookback], True, stop_str)
        if self.include_stop_str_in_output:
            if self._lookback_size:
                self._lookback = (self._lookback + text)[-self._lookback_size :]
            return StopCheckResult(text)
        held = self._partial_suffix_length(text)
        self._pending = text[len(text) - held :] if held else ""
        return StopCheckResult(text[: len(text) - held])

    def flush(self) -> str:
        """Release the held-back tail (generation ended without a stop string)."""
        text, self._pending = self._pending, ""
        return "" if self._stopped else text

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            start = text.find(stop_str)
            if start < 0:
                continue
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_suffix_length(self, text: str) -> int:
        """The length of the longest tail of ``text`` that a stop string starts with."""
        longest = 0
        for stop_str in self.stop:
            for size in range(min(len(stop_str) - 1, len(text)), longest, -1):
                if text.endswith(stop_str[:size]):
                    longest = size
                    break
        return longest


def find_stop(
    text: str, stop: Sequence[str], include_stop_str_in_output: bool = False
) -> StopCheckResult:
    """Non-streaming stop-string check of a whole output text.

    Returns:
        The text to return (cut at the stop string) and which stop string matched, if any.
    """
    checker = StopStringChecker(stop, include_stop_str_in_output)
    result = checker.append(text)
    if result.is_stopped:
        return result
    return StopCheckResult(result.text + checker.flush())
