"""``engine``: entry point of the command line; each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from engine.core import __version__
from engine.sdk._version import __version__ as sdk_version
from engine.server.cli import _generate, _kernels, _plugins, _serve
from engine.server.cli._config_file import ConfigFileError, expand_config_file, normalize_flag
from engine.server.cli._help import HelpFormatter
from engine.server.cli._logging_args import LOG_LEVELS


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (``engine --help``)."""
    parser = argparse.ArgumentParser(
        prog="engine",
        description="LLM inference and serving engine with a stable plugin SDK.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version",
        version=f"engine {__version__} (engine-plugin-sdk {sdk_version})",
    )
    parser.add_argument(
        "--log-level", default=None, type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
        help=f"logging level: {', '.join(LOG_LEVELS)}, in any case; also accepted after the "
        f"subcommand (default: INFO for serve, WARNING otherwise)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    _plugins.add_parser(commands)
    _kernels.add_parser(commands)
    _generate.add_parser(commands)
    _serve.add_parser(commands)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line the way vLLM does.

    ``--config FILE.yaml`` is expanded in place, and ``--max_model_len`` is
    ``--max-model-len``.

    Raises:
        ConfigFileError: the ``--config`` file or one of its keys is wrong.
        SystemExit: argparse's usage error (status 2) or ``--help``.
    """
    parser = build_parser()
    words = expand_config_file(parser, [normalize_flag(arg) for arg in argv])
    return parser.parse_args(words)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
