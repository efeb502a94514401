"""Generated from proto/engine/v1 by scripts/gen_proto.py (``nox -s proto``): do not edit."""
