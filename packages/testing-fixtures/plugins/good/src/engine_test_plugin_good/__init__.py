"""A working plugin distribution with entries in several groups."""

import os

#: How many times ``register`` ran in this process (general plugins run once per process).
REGISTER_CALLS = 0


def register() -> None:
    """General plugin: runs once per process; leaves an observable mark."""
    global REGISTER_CALLS
    REGISTER_CALLS += 1
    os.environ["ENGINE_TEST_PLUGIN_GOOD_REGISTERED"] = str(REGISTER_CALLS)
