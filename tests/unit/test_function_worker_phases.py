"""A worker that answered its call prepares the next call's process before it gets another:
the pool counts it as starting until it says ``ready`` again."""

from __future__ import annotations

import selectors
import socket
from collections.abc import Iterator

import pytest

from dsec.edge.backends.function.pool import ImagePool, PendingCall, Pool, Worker

IMAGE = ("/layers/a",)


class Phases(Pool):
    """Only the pool's worker bookkeeping (no forker, cgroups or processes)."""

    def __init__(self) -> None:  # not the pool's own, which starts processes
        self.sel = selectors.DefaultSelector()
        self.images = {IMAGE: ImagePool(users=1)}
        self.workers: dict[int, Worker] = {}
        self.started_workers = 0
        self.handed: list[tuple[Worker, PendingCall]] = []

    def _start_worker(self, image: tuple[str, ...]) -> None:
        self.started_workers += 1

    def _hand_over(self, w: Worker, call: PendingCall) -> None:
        self.handed.append((w, call))
        w.phase = "busy"
        self.images[w.image].busy += 1


@pytest.fixture
def setup() -> Iterator[tuple[Phases, Worker, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pool = Phases()
    w = Worker(seq=1, image=IMAGE, sock=ours, cgroup="/x/w1", pid=0, phase="busy")
    pool.workers[1] = w
    pool.images[IMAGE].busy = 1
    pool.sel.register(ours, selectors.EVENT_READ, ("worker", w))
    yield pool, w, theirs
    theirs.close()
    ours.close()
    pool.sel.close()


def test_a_worker_that_answered_gets_no_call_until_its_next_process_is_ready(
    setup: tuple[Phases, Worker, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, w, worker_end = setup
    monkeypatch.setattr("dsec.edge.backends.function.pool.WARM", 1)
    image = pool.images[IMAGE]
    call = PendingCall(sandbox=None, conn=None, request={})  # type: ignore[arg-type]
    worker_end.send(b"done")
    pool._on_worker(w)
    assert (w.phase, image.busy, image.starting, list(image.ready)) == ("starting", 0, 1, [])
    image.pending.append(call)
    pool._dispatch(IMAGE)
    assert pool.handed == []  # it is still preparing: the call waits (or goes elsewhere)
    assert pool.started_workers == 0  # a preparing worker counts: no extra one is started
    worker_end.send(b"ready")
    pool._on_worker(w)
    assert pool.handed == [(w, call)]
    assert image.starting == 0


def test_a_spare_worker_is_retired_when_its_call_is_done(
    setup: tuple[Phases, Worker, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, w, worker_end = setup
    monkeypatch.setattr("dsec.edge.backends.function.pool.WARM", 0)
    killed: list[Worker] = []
    monkeypatch.setattr(pool, "_kill", killed.append, raising=False)
    worker_end.send(b"done")
    pool._on_worker(w)
    assert killed == [w]
    assert (w.phase, pool.images[IMAGE].starting) == ("retiring", 0)
