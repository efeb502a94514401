"""The ``engine`` command line."""

from engine.server.cli._main import main

__all__ = ["main"]
