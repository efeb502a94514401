"""General plugin: a once-per-process registration with an observable effect."""

from __future__ import annotations

import os

from engine_test_plugin_sdk1.counters import count

#: Set in ``os.environ`` by :func:`register`, to the pid of the process it ran in.
ENV_MARKER = "ENGINE_TEST_SDK1_REGISTERED"

#: What :func:`register` registered: name -> value (a stand-in for a real registry).
REGISTRY: dict[str, str] = {}


def register() -> None:
    """engine.general_plugins entry: idempotent, cheap, quiet."""
    count("sdk1_register.call")
    if "sdk1" in REGISTRY:  # a second engine in the same process: nothing to do
        return
    REGISTRY["sdk1"] = "engine-test-plugin-sdk1"
    os.environ[ENV_MARKER] = str(os.getpid())
