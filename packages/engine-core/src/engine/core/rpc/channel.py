"""Options both ends of the private gRPC channels share (front end <-> EngineCore <-> workers)."""

from __future__ import annotations

from typing import Any

#: Call metadata key carrying the per-launch secret (TCP only).
SECRET_METADATA_KEY = "x-engine-secret"
#: Messages may be large (a batch of long prompts); gRPC's default cap is 4 MiB.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
#: Seconds a unary call waits for the loop to run it (it runs between two steps).
CALL_TIMEOUT_S = 60.0

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
#: The server accepts the client's 1 s keepalive pings (TCP death detection).
SERVER_OPTIONS: list[tuple[str, Any]] = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]

#: Client keepalive over TCP: a silent peer is declared gone after about two seconds.
TCP_KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

__all__ = ["CALL_TIMEOUT_S", "CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES", "SECRET_METADATA_KEY",
           "SERVER_OPTIONS", "TCP_KEEPALIVE_OPTIONS"]
