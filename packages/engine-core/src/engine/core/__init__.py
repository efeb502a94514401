"""The engine core. Public names are re-exported here as they land."""

from engine.core._version import __version__

__all__ = ["__version__"]
