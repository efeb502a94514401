"""Logging flags: ``--log-level`` before or after the subcommand, and ``serve``'s.

``serve`` also takes vLLM's ``--enable-log-requests`` / ``--disable-log-requests``,
``--max-log-len`` and ``--uvicorn-log-level``.
"""

from __future__ import annotations

import argparse
import logging

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
UVICORN_LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "critical")
#: uvicorn's own level below DEBUG.
TRACE = 5
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def add_log_level(parser: argparse.ArgumentParser, *, default_text: str) -> None:
    """``--log-level`` (any case); on a subcommand it leaves the main parser's value alone."""
    parser.add_argument(
        "--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
        default=argparse.SUPPRESS, help=f"logging level: {', '.join(LOG_LEVELS)}, in any "
        f"case (default: {default_text})")


def add_serve_logging_args(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` logging group: request lines, uvicorn's level, ``--log-level``."""
    group = parser.add_argument_group("logging options")
    group.add_argument("--enable-log-requests", dest="enable_log_requests",
                       action="store_true", default=False,
                       help="log each generation request's prompt and sampling parameters "
                       "at INFO (default: off)")
    group.add_argument("--disable-log-requests", dest="enable_log_requests",
                       action="store_false",
                       help="vLLM's older spelling of the default: no request lines")
    group.add_argument("--max-log-len", type=int, default=None, metavar="N",
                       help="characters (and token ids) of a prompt shown in a request line "
                       "(default: all)")
    group.add_argument("--uvicorn-log-level", type=str.lower, choices=UVICORN_LOG_LEVELS,
                       default=None, metavar="LEVEL",
                       help=f"level of uvicorn's own loggers (startup lines, access log): "
                       f"{', '.join(UVICORN_LOG_LEVELS)} (default: --log-level's)")
    add_log_level(parser, default_text="INFO")


def apply_uvicorn_log_level(level: str | None) -> None:
    """Set uvicorn's loggers to ``level`` (None: leave them to follow ``--log-level``).

    What uvicorn itself does with ``log_level``; the server gives uvicorn no logging
    config of its own, so its records reach the engine's handler.
    """
    if level is None:
        return
    logging.addLevelName(TRACE, "TRACE")
    number = TRACE if level == "trace" else logging.getLevelName(level.upper())
    for name in _UVICORN_LOGGERS:
        logging.getLogger(name).setLevel(number)
