"""Channel and server options that must agree on both ends of every internal connection.

Messages may be up to 64 MiB each way (file transfers should still stream in chunks). Clients
ping every 20 s, also when idle, and give up on a dead peer after 10 s; servers accept pings
as often as every 10 s, so they never answer a client's keepalive with GOAWAY
``too_many_pings`` (measured: with gRPC's default server floor of 5 minutes the channel was
dropped after 60 s idle).
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CLIENT_KEEPALIVE_MS = 20_000
SERVER_KEEPALIVE_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_PING_INTERVAL_MS = 10_000  # the server's floor; below CLIENT_KEEPALIVE_MS on purpose

Options = list[tuple[str, int | str]]


def _common() -> Options:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def client_options(keepalive_ms: int = CLIENT_KEEPALIVE_MS) -> Options:
    """Options for every internal channel (``keepalive_ms`` is changed only by tests)."""
    return [*_common(), ("grpc.keepalive_time_ms", keepalive_ms), ("grpc.enable_retries", 1)]


def server_options(min_ping_interval_ms: int = MIN_PING_INTERVAL_MS) -> Options:
    """Options for every internal server (the interval is changed only by tests)."""
    return [
        *_common(),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 2),
        # gRPC sets SO_REUSEPORT by default: a second daemon on the same port would silently
        # share the traffic instead of failing to start.
        ("grpc.so_reuseport", 0),
    ]


CLIENT_OPTIONS = client_options()
SERVER_OPTIONS = server_options()
