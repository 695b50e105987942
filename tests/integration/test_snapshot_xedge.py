"""A full microVM snapshot starts a sandbox on another edge: two edges (two sandboxes each) in
separate processes on this machine (QEMU TCG), the snapshot streamed from one to the other
through the apiserver and checked by digest, asked for (``edge=``) or because the
snapshot's edge is full, and a fork onto the other edge; a corrupt snapshot and the source
edge dying mid-transfer are refused with a clear error and leave nothing on the target."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from dsec.core import errors
from dsec.sdk import Client, Sandbox
from dsec.testing.cluster import LocalCluster
from tests.integration.xedge import HELLO, Edge, cluster, source_sandbox, staged
from tests.waits import until

pytestmark = [pytest.mark.guest_kernel, pytest.mark.timeout(900)]
__all__ = ["cluster"]  # the two-edge fixture


def test_full_snapshot_on_another_edge_corrupt_and_source_death(
    cluster: tuple[LocalCluster, Client, list[Edge]],
) -> None:
    c, api, edges = cluster
    # 48 MiB: data a transfer takes a moment for
    with source_sandbox(api, edges, fill_mb=48) as (src, a, b, made):
        sh = src.shell("work")
        # a fork on its own edge first: the source's disk now stands on a fork template,
        # which goes along (qcow2 backing chain) and is rebased on the other edge
        kid = src.fork(count=1)[0]
        made.append(kid)
        assert kid.info().edge_id == a.id
        src.files.write("/root/after.txt", b"written after the fork")
        snap = src.snapshot("xedge")
        assert snap.edge_id == a.id

        started = time.monotonic()
        child = Sandbox.from_snapshot(snap.id, edge=b.id, timeout=300, client=api)
        made.append(child)
        took = time.monotonic() - started
        assert child.info().edge_id == b.id
        assert child.files.read("/root/hello.txt") == HELLO
        assert child.files.read("/root/after.txt") == b"written after the fork"
        assert child.shell("work").run("echo $X").stdout.strip() == "42"
        assert child.exec("stat -c %s /dev/shm/fill").stdout.strip() == str(48 << 20)
        assert [s.id for s in api.list_snapshots()] == [snap.id]  # the copy was dropped
        print(f"create from a snapshot on another edge: {took:.1f} s")
        child.kill()
        # a fork onto the other edge: a snapshot of the parent, copied, children from it
        started = time.monotonic()
        cached = sorted(b.mem.glob("cache-*"))
        forked = src.fork(count=1, edge=b.id)
        made += forked
        print(f"fork onto another edge: {time.monotonic() - started:.1f} s")
        assert forked[0].info().edge_id == b.id
        assert forked[0].shell("work").run("echo $X").stdout.strip() == "42"
        assert sh.run("echo $X").stdout.strip() == "42"  # the parent goes on
        assert [s.id for s in api.list_snapshots()] == [snap.id]  # none left by the fork
        assert sorted(b.mem.glob("cache-*")) == cached  # nor kept in the target's cache
        forked[0].kill()
        # the snapshot's edge is full (two sandboxes each): the apiserver copies it over
        moved = Sandbox.from_snapshot(snap.id, timeout=300, client=api)
        made.append(moved)
        assert moved.info().edge_id == b.id
        assert moved.files.read("/root/hello.txt") == HELLO
        moved.kill()
        auto = src.fork(count=1)  # the same for a fork: the parent's edge is full
        made += auto
        assert auto[0].info().edge_id == b.id
        assert auto[0].shell("work").run("echo $X").stdout.strip() == "42"
        auto[0].kill()
        with pytest.raises(errors.InvalidArgument, match="no edge"):
            Sandbox.from_snapshot(snap.id, edge="nope", client=api)
        src.kill()
        kid.kill()  # nothing runs on the source edge when it is killed below
        until(lambda: b.leftovers() == [], "the copy's files go with its last sandbox", 30)

        # a snapshot whose device state (here with the RAM: the source had forked) changed
        # on the source since it was taken is refused (b no longer has a copy of it)
        b.drop_cache()
        state = a.templates / snap.id / "state"
        with open(state, "r+b") as f:
            f.seek(4096)
            first = f.read(1)
            f.seek(4096)
            f.write(bytes([first[0] ^ 0xFF]))
        with pytest.raises(errors.SandboxFailed, match="does not match its digest"):
            Sandbox.from_snapshot(snap.id, edge=b.id, timeout=300, client=api)
        assert b.leftovers() == []
        with open(state, "r+b") as f:
            f.seek(4096)
            f.write(first)

        # the source edge dies mid-transfer: a clear error, nothing on the target
        failure: list[BaseException] = []

        def create() -> None:
            try:
                made.append(Sandbox.from_snapshot(snap.id, edge=b.id, timeout=300, client=api))
            except BaseException as exc:
                failure.append(exc)

        t = threading.Thread(target=create)
        t.start()
        until(lambda: staged(b) > 4 << 20 or not t.is_alive(), "the transfer started", 120)
        c.stop(a.proc, signal.SIGKILL)
        t.join(300)
        assert not t.is_alive()
        assert len(failure) == 1, f"the transfer was not cut off: {made}"
        assert isinstance(failure[0], errors.Unavailable), failure[0]
        assert a.id in str(failure[0])
        until(lambda: b.leftovers() == [], "the partial copy removed", 30)
        assert api.usage()["sandboxes"] == 0, api.usage()  # no admission kept
