"""Plugins written once against engine-plugin-sdk 1.0.0, one per entry-point group.

FROZEN: never edit this package (see ../../README.md). Each module is one plugin; the
engine imports only the ones it selects. Every plugin counts what it does in
:data:`engine_test_plugin_sdk1.counters.CALLS`, so a test can prove it was reached.
"""
