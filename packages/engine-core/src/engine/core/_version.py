"""The engine's version (core, kernels and server move in lockstep)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("engine-core")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"
