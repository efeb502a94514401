"""StopStringChecker: streaming with any chunking equals the non-streaming result."""

from __future__ import annotations

import random

import pytest

from engine.core.tokenizer import StopCheckResult, StopStringChecker, find_stop
from engine.sdk.errors import ValidationError


def run_stream(
    text: str, stop: list[str], include: bool, chunks: list[int]
) -> tuple[str, list[str], StopCheckResult | None]:
    """Feed ``text`` in chunks; return the emitted text, the deltas and the stopping result."""
    checker = StopStringChecker(stop, include)
    deltas: list[str] = []
    pos = 0
    for size in chunks:
        result = checker.append(text[pos : pos + size])
        pos += size
        deltas.append(result.text)
        if result.is_stopped:
            return "".join(deltas), deltas, result
    deltas.append(checker.flush())
    return "".join(deltas), deltas, None


def brute_force(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """The definition: stop at the match that ends first (then starts first)."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stop if text[:end].endswith(s)]
        if matches:
            longest = max(matches, key=len)
            cut = end if include else end - len(longest)
            return text[:cut], longest
    return text, None


def test_basic() -> None:
    assert find_stop("Hello\nUser: hi", ["\nUser:"]) == StopCheckResult("Hello", True, "\nUser:")
    assert find_stop("Hello\nUser: hi", ["\nUser:"], True) == StopCheckResult(
        "Hello\nUser:", True, "\nUser:"
    )
    assert find_stop("no stop here", ["STOP"]) == StopCheckResult("no stop here", False, None)
    assert find_stop("anything", []) == StopCheckResult("anything", False, None)


def test_holds_back_possible_start_and_releases_it() -> None:
    checker = StopStringChecker(["\nUser:"])
    assert checker.append("Hello\nUs") == StopCheckResult("Hello")
    assert checker.append("ually") == StopCheckResult("\nUsually")
    assert checker.append(" ok\n") == StopCheckResult(" ok")
    assert checker.flush() == "\n"


def test_stop_across_chunks_and_after_stop() -> None:
    checker = StopStringChecker(["</s>"])
    assert checker.append("answer</").text == "answer"
    result = checker.append("s>trailing")
    assert result == StopCheckResult("", True, "</s>")
    assert checker.is_stopped
    assert checker.append("more") == StopCheckResult("", True, None)
    assert checker.flush() == ""


def test_first_to_complete_wins() -> None:
    # "c" completes before "abcd" does, however the text arrives.
    assert find_stop("xabcd", ["abcd", "c"]) == StopCheckResult("xab", True, "c")
    # Same end: the longer (earlier starting) one.
    assert find_stop("xabc", ["bc", "abc"]) == StopCheckResult("x", True, "abc")
    assert find_stop("xabc", ["bc", "abc"], True) == StopCheckResult("xabc", True, "abc")


def test_include_stop_str_does_not_hold_back() -> None:
    checker = StopStringChecker(["END"], include_stop_str_in_output=True)
    assert checker.append("the EN").text == "the EN"
    assert checker.append("D!") == StopCheckResult("D", True, "END")


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValidationError) as info:
        StopStringChecker(["ok", ""])
    assert info.value.param == "stop"


def test_unicode() -> None:
    assert find_stop("答案是 42。\n\n问题", ["\n\n问"]) == StopCheckResult(
        "答案是 42。", True, "\n\n问"
    )
    checker = StopStringChecker(["😀👍"])
    assert checker.append("hi 😀").text == "hi "
    assert checker.append("👍") == StopCheckResult("", True, "😀👍")


@pytest.mark.parametrize("include", [False, True])
def test_streaming_equals_non_streaming_random(include: bool) -> None:
    rng = random.Random(7 + include)
    alphabet = "ab\nc"
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stop = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        expected_text, expected_stop = brute_force(text, stop, include)
        whole = find_stop(text, stop, include)
        assert (whole.text, whole.stop_str) == (expected_text, expected_stop), (text, stop)
        char_chunks = [1] * len(text)
        random_chunks: list[int] = []
        while sum(random_chunks) < len(text):
            random_chunks.append(rng.randint(1, 6))
        for chunks in (char_chunks, random_chunks, [len(text) + 1]):
            emitted, _, result = run_stream(text, stop, include, chunks)
            assert emitted == expected_text, (text, stop, chunks)
            assert (result.stop_str if result else None) == expected_stop
        # Streamed deltas are only ever appended, so equality with the non-streaming text
        # (which never contains the stop string) means no part of a stop string was shown.
        # Nothing is held back longer than needed: what is not shown yet is a proper prefix
        # of a stop string (never anything with include_stop_str_in_output).
        checker = StopStringChecker(stop, include)
        shown = ""
        for end in range(1, len(text) + 1):
            step = checker.append(text[end - 1])
            shown += step.text
            if step.is_stopped:
                break
            held = text[len(shown) : end]
            assert not held if include else any(s.startswith(held) for s in stop), (held, stop)
