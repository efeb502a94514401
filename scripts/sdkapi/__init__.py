"""Tools that keep the SDK's promise: API snapshots, the compatibility gate, releases.

Used by ``scripts/sdk_api.py`` (``nox -s api_compat``, ``nox -s release_sdk``); see
docs/plugins/versioning.md for the rules they enforce.
"""
