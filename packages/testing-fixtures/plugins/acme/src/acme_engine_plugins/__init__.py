"""acme-engine-plugins: one plugin for every extension point of the engine.

Each module is one plugin (its entry point is in ``pyproject.toml``); nothing here is
imported by the engine until the plugin is selected. See README.md for what each does.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
