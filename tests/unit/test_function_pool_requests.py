"""The function pool reads a call's request frame itself: all that arrived, nothing beyond."""

from __future__ import annotations

import selectors
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.agent import protocol
from dsec.edge.backends.function.pool import HalfRead, Pool, Sandbox


class Reader(Pool):
    """Only the pool's request reading (no forker, cgroups or workers)."""

    def __init__(self) -> None:  # not the pool's own, which starts processes
        self.sel = selectors.DefaultSelector()
        self.routed: list[dict[str, Any]] = []

    def _route(self, sb: Sandbox, conn: socket.socket, req: dict[str, Any]) -> None:
        self.routed.append(req)


@pytest.fixture
def pair() -> Iterator[tuple[Reader, HalfRead, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader = Reader()
    half = HalfRead(Sandbox.__new__(Sandbox), ours)
    reader.sel.register(ours, selectors.EVENT_READ, ("request", half))
    yield reader, half, theirs
    theirs.close()
    ours.close()
    reader.sel.close()


def test_header_and_body_that_arrived_together_are_read_in_one_event(
    pair: tuple[Reader, HalfRead, socket.socket],
) -> None:
    reader, half, client = pair
    stdin = protocol.encode(protocol.KIND_IN, b"not part of the request")
    client.sendall(protocol.encode_json({"op": "exec", "cmd": ["true"]}) + stdin)
    reader._on_request(half)
    assert reader.routed == [{"op": "exec", "cmd": ["true"]}]
    assert reader.sel.get_map() == {}
    assert half.conn.recv(100) == stdin  # left for the worker's command


def test_a_frame_in_pieces_waits_for_the_rest_even_within_the_header(
    pair: tuple[Reader, HalfRead, socket.socket],
) -> None:
    reader, half, client = pair
    frame = protocol.encode_json({"op": "ping"})
    client.sendall(frame[:3])
    reader._on_request(half)
    client.sendall(frame[3:-2])
    reader._on_request(half)
    assert reader.routed == []
    assert half.conn in [k.fileobj for k in reader.sel.get_map().values()]
    client.sendall(frame[-2:])
    reader._on_request(half)
    assert reader.routed == [{"op": "ping"}]


def test_a_frame_that_is_not_a_request_is_answered_with_an_error(
    pair: tuple[Reader, HalfRead, socket.socket],
) -> None:
    reader, half, client = pair
    client.sendall(protocol.encode(protocol.KIND_IN, b"data first"))
    reader._on_request(half)
    assert reader.routed == []
    kind, payload = _frame(client.recv(1000))
    assert kind == protocol.KIND_JSON
    assert protocol.decode_json(payload)["error"]["code"] == "invalid_argument"


def _frame(data: bytes) -> tuple[int, bytes]:
    length, kind = protocol.parse_header(data[: protocol.HEADER.size])
    return kind, data[protocol.HEADER.size : protocol.HEADER.size + length]
