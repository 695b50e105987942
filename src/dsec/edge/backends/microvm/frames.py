"""The wire protocol of the host<->guest agent channel (a virtio-serial port or a vsock stream).

The edge accepts many concurrent connections on a sandbox's agent socket; a VM has one
host<->guest stream. Both ends cut it into frames::

    +---------+---------------+----------------+-----------------+
    | type: 1 | channel: u32  | length: u32 BE | payload         |
    +---------+---------------+----------------+-----------------+

``OPEN`` (host) starts channel n: the guest connects to aether's socket for it. ``DATA``
carries bytes either way. ``CLOSE`` ends a channel (either side, either way; the other
side closes its end). ``HELLO`` (host) is the first frame after the host (re)connects:
the guest drops every channel it still had and applies the JSON identity it carries
(hostname, machine id, an RNG seed: set again in fork children; the host's clock, since
a restored guest's clock stood still). The guest answers ``READY``.

Flow control, per channel: a host that offers it puts ``"window": n`` in HELLO; a guest
that takes it answers READY with ``{"window": n}``. Then each side has at most ``n``
bytes of DATA unacknowledged per channel, and a receiver answers ``CREDIT`` (payload: a
u32 byte count) for what it has handed to its local socket. A receiver queues DATA per
channel and never blocks the link on one channel, so one stream nobody reads (a big
upload aether does not take yet, a download the caller does not read) holds up only
itself. Without the offer (an older peer) DATA is written through as it arrives.

The host end is :mod:`dsec.edge.backends.microvm.mux`; the guest end, in a microVM and in
a full VM alike, is ``guest/vmport.c`` (linked into a microVM's PID 1, a program of its
own in the full VM's image). tests/unit/test_microvm_mux.py runs them against each other.
"""

from __future__ import annotations

import json
import struct

HEADER = struct.Struct(">BII")
OPEN, DATA, CLOSE, HELLO, READY, CREDIT = 1, 2, 3, 4, 5, 6
MAX_PAYLOAD = 1 << 20
CHUNK = 64 * 1024
WINDOW = 256 * 1024  # unacknowledged DATA bytes per channel and direction
COUNT = struct.Struct(">I")
VSOCK_PORT = 1027  # under Firecracker the host connects here (hybrid vsock)


class MuxError(Exception):
    pass


def frame(kind: int, channel: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, channel, len(payload)) + payload


def parse(buf: bytearray) -> list[tuple[int, int, bytes]]:
    """Take every complete frame off the front of ``buf``."""
    out = []
    while len(buf) >= HEADER.size:
        kind, chan, n = HEADER.unpack_from(buf)
        if n > MAX_PAYLOAD or kind not in (OPEN, DATA, CLOSE, HELLO, READY, CREDIT):
            raise MuxError(f"bad frame: type {kind}, length {n}")
        if len(buf) < HEADER.size + n:
            break
        out.append((kind, chan, bytes(buf[HEADER.size : HEADER.size + n])))
        del buf[: HEADER.size + n]
    return out


def window_of(payload: bytes) -> int:
    """The flow-control window a HELLO or READY payload offers (0: none)."""
    try:
        n = json.loads(payload).get("window") if payload else 0
    except (ValueError, AttributeError):
        return 0
    return min(n, WINDOW) if isinstance(n, int) and n >= CHUNK else 0
