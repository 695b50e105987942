"""Typed, fixed-width public identifiers.

A sandbox id names its owning edge so any apiserver can forward without a routing table::

    sbx-<edge:4>-<random:20>      e.g. sbx-e0a1-k3j5n7q9x2m4p8r6t2ab

Only lowercase letters, digits and hyphens, 29 characters: a valid DNS label, so
``<port>-<sandbox id>.<domain>`` host routing works. The random part is 100 bits of base32.
Randomness comes in as a parameter: this module does no I/O.
"""

from __future__ import annotations

import re

from dsec.core.errors import InvalidArgument, SandboxNotFound, SnapshotNotFound

SANDBOX_PREFIX = "sbx"
EDGE_ID_LEN = 4
RANDOM_LEN = 20
RANDOM_BYTES = 13  # 104 bits, base32-encoded and cut to 20 characters (100 bits)

_EDGE_RE = re.compile(r"^[a-z0-9]{4}$")
_SANDBOX_RE = re.compile(rf"^{SANDBOX_PREFIX}-([a-z0-9]{{4}})-([a-z2-7]{{{RANDOM_LEN}}})$")
SNAPSHOT_PREFIX = "snp"
_SNAPSHOT_RE = re.compile(rf"^{SNAPSHOT_PREFIX}-([a-z0-9]{{4}})-([a-z2-7]{{{RANDOM_LEN}}})$")
_API_KEY_RE = re.compile(r"^dsk_([a-z0-9]{12})_([A-Za-z0-9_-]{43})$")


def validate_edge_id(edge_id: str) -> str:
    if not _EDGE_RE.match(edge_id):
        raise InvalidArgument(f"edge id must be 4 lowercase letters or digits, got {edge_id!r}")
    return edge_id


def new_sandbox_id(edge_id: str, random_bytes: bytes) -> str:
    """Format a sandbox id for ``edge_id`` from at least 13 random bytes."""
    validate_edge_id(edge_id)
    if len(random_bytes) < RANDOM_BYTES:
        raise ValueError(f"need {RANDOM_BYTES} random bytes, got {len(random_bytes)}")
    return f"{SANDBOX_PREFIX}-{edge_id}-{_base32_head(random_bytes)}"


_B32 = "abcdefghijklmnopqrstuvwxyz234567"  # RFC 4648's alphabet, lowercase
_B32_PAIRS = [a + b for a in _B32 for b in _B32]  # 10 bits -> 2 characters
_HEAD_SHIFTS = tuple(range(RANDOM_LEN * 5 - 10, -1, -10))


def _base32_head(random_bytes: bytes) -> str:
    """The first RANDOM_LEN characters of the lowercase base32 of the first RANDOM_BYTES
    bytes (the first 100 bits, 10 at a time): ``base64.b32encode``'s, without its loop
    over every 5-byte group (a sandbox id is made for every create)."""
    bits = int.from_bytes(random_bytes[:RANDOM_BYTES], "big") >> (RANDOM_BYTES * 8 - RANDOM_LEN * 5)
    return "".join([_B32_PAIRS[(bits >> s) & 1023] for s in _HEAD_SHIFTS])


def edge_of(sandbox_id: str) -> str:
    """Return the edge id encoded in a sandbox id; a malformed id is simply not found."""
    m = _SANDBOX_RE.match(sandbox_id)
    if not m:
        raise SandboxNotFound(f"no sandbox {sandbox_id!r} (malformed sandbox id)")
    return m.group(1)


def is_sandbox_id(value: str) -> bool:
    return _SANDBOX_RE.match(value) is not None


def new_snapshot_id(edge_id: str, random_bytes: bytes) -> str:
    """A snapshot id names its edge like a sandbox id: ``snp-<edge:4>-<random:20>``."""
    return SNAPSHOT_PREFIX + new_sandbox_id(edge_id, random_bytes)[len(SANDBOX_PREFIX) :]


def snapshot_edge_of(snapshot_id: str) -> str:
    """The edge id encoded in a snapshot id; a malformed id is simply not found."""
    m = _SNAPSHOT_RE.match(snapshot_id)
    if not m:
        raise SnapshotNotFound(f"no snapshot {snapshot_id!r} (malformed snapshot id)")
    return m.group(1)


def is_snapshot_id(value: str) -> bool:
    return _SNAPSHOT_RE.match(value) is not None


def format_api_key(key_id: str, secret: str) -> str:
    return f"dsk_{key_id}_{secret}"


def parse_api_key(token: str) -> tuple[str, str]:
    """Split an API key into (key id, secret); raises InvalidArgument if malformed."""
    m = _API_KEY_RE.match(token)
    if not m:
        raise InvalidArgument("malformed API key (expected dsk_<id>_<secret>)")
    return m.group(1), m.group(2)
