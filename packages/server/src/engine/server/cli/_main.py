"""``engine``: entry point of the command line; each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from engine.core import __version__
from engine.sdk._version import __version__ as sdk_version
from engine.server.cli import _generate, _plugins, _serve


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (``engine --help``)."""
    parser = argparse.ArgumentParser(
        prog="engine",
        description="LLM inference and serving engine with a stable plugin SDK.",
    )
    parser.add_argument(
        "--version", action="version",
        version=f"engine {__version__} (engine-plugin-sdk {sdk_version})",
    )
    parser.add_argument(
        "--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: INFO for serve, WARNING otherwise)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    _plugins.add_parser(commands)
    _generate.add_parser(commands)
    _serve.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level or getattr(args, "default_log_level", "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status: int = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `engine plugins list | head`
        sys.stderr.close()
        return 0
    return status


if __name__ == "__main__":
    sys.exit(main())
