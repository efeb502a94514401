"""What this distribution's plugins did in this process (``"<plugin>.<event>"`` -> count)."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

CALLS: Counter[str] = Counter()

#: Set to a file path to get one JSON line per ``create_weights`` (any process).
LOG_ENV = "ENGINE_TEST_QUANT_LOG"


def count(event: str, n: int = 1) -> None:
    """Add ``n`` to ``event``."""
    CALLS[event] += n


def log(record: dict[str, Any]) -> None:
    """Append ``record`` to ``$ENGINE_TEST_QUANT_LOG`` when it is set."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")
