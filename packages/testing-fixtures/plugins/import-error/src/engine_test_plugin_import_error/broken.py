"""Imports a module that does not exist, as a plugin with a missing dependency would."""

import engine_test_missing_dependency  # noqa: F401

Processor = None
