"""Tokenizer, chat template, incremental detokenizer and stop strings (front-end side)."""

from engine.core.tokenizer.detokenizer import (
    INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET,
    IncrementalDetokenizer,
)
from engine.core.tokenizer.loader import load_tokenizer, read_chat_template
from engine.core.tokenizer.stop_strings import StopCheckResult, StopStringChecker, find_stop
from engine.core.tokenizer.tokenizer import Tokenizer

__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "read_chat_template",
    "IncrementalDetokenizer",
    "INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET",
    "StopCheckResult",
    "StopStringChecker",
    "find_stop",
]
