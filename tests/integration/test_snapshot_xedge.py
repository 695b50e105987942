"""A full microVM snapshot starts a sandbox on another edge: two edges (two sandboxes each) in
separate processes on this machine (QEMU TCG), the snapshot streamed from one to the other
through the apiserver and checked by digest, asked for (``edge=``) or because the
snapshot's edge is full, and a fork onto the other edge; a corrupt snapshot and the source
edge dying mid-transfer are refused with a clear error and leave nothing on the target."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.core import errors
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.microvm.backend import _short_hash
from dsec.paths import Paths
from dsec.sdk import Client, Sandbox
from dsec.testing.cluster import LocalCluster, Proc, local_cluster
from tests.integration.vmkit import microvm_skip_reason

pytestmark = [pytest.mark.guest_kernel, pytest.mark.timeout(900)]


def _skip() -> str | None:
    why = microvm_skip_reason()
    if why:
        return why
    agent = Paths.from_env().data / "agent" / "site" / "dsec" / "agent" / "vmport.py"
    return None if agent.exists() else "the installed agent bundle predates microVMs: dsec setup"


class Edge:
    def __init__(self, proc: Proc, edge_id: str, parent: str) -> None:
        self.proc, self.id, self.cgroup_parent = proc, edge_id, parent
        self.home = proc.home
        self.mem = Path("/dev/shm") / f"dsec-vm-{_short_hash(proc.home)}"
        self.templates = proc.home / "edge" / "vm-templates"

    def leftovers(self) -> list[str]:
        """Snapshot, template, staging and RAM files on this edge (not the cache of
        copies received: ``cache-*``)."""
        out = []
        for d in (self.templates, self.mem, self.home / "edge" / "vm-bases"):
            if d.exists():
                out += [str(p.relative_to(d)) for p in d.iterdir()
                        if not p.name.startswith("cache-")]  # fmt: skip
        return sorted(out)

    def drop_cache(self) -> None:
        """Empty the cache of received snapshot files (as its size bound would)."""
        for p in self.mem.glob("cache-*"):
            p.unlink()
        shutil.rmtree(self.home / "edge" / "vm-cache", ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[LocalCluster, Client, list[Edge]]]:
    why = _skip()
    if why:
        pytest.skip(why)
    tag = os.urandom(3).hex()
    edges: list[Edge] = []
    with local_cluster(apiservers=1) as c:
        admin = Client(api_url=c.api_url(0), api_key=c.admin_key)
        try:
            for n in range(2):
                parent = f"dsecx-{tag}-{n}"
                extra = ["--cgroup-parent", parent, "--max-sandboxes", "2"]
                p = c.add_edge(admin.create_join_token(600)["token"], backend="real", extra=extra)
                deadline = time.monotonic() + 60
                while True:
                    ids = [e["edge_id"] for e in admin.list_edges()
                           if e.get("address") == p.address and e["healthy"]]  # fmt: skip
                    if ids:
                        break
                    assert time.monotonic() < deadline, "edge did not report"
                    time.sleep(0.2)
                edges.append(Edge(p, str(ids[0]), parent))
            yield c, admin, edges
        finally:
            admin.close()
    for e in edges:  # what a killed edge could not clean up itself
        shutil.rmtree(e.mem, ignore_errors=True)
        cgroups.remove(cgroups.detect(), "/" + e.cgroup_parent)


def _staged(edge: Edge) -> int:
    """Bytes staged by an import in progress on ``edge``."""
    n = 0
    for d in (edge.mem, edge.templates):
        for p in d.glob(".import-*/**/*" if d == edge.templates else ".import-*"):
            with contextlib.suppress(OSError):
                n += p.stat().st_blocks * 512 if p.is_file() else 0
    return n


def test_full_snapshot_on_another_edge_corrupt_and_source_death(
    cluster: tuple[LocalCluster, Client, list[Edge]],
) -> None:
    c, api, (a, b) = cluster
    src = Sandbox.create(backend="microvm", memory_mb=256, timeout=600, client=api)
    assert src.info().edge_id in (a.id, b.id)
    if src.info().edge_id == b.id:
        a, b = b, a
    made: list[Sandbox] = []
    try:
        src.files.write("/root/hello.txt", b"from the source edge")
        sh = src.shell("work")
        sh.run("export X=42")
        # data a transfer takes a moment for (random: zero pages are not sent)
        src.exec("head -c 48M /dev/urandom > /dev/shm/fill", timeout=240)
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
        assert child.files.read("/root/hello.txt") == b"from the source edge"
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
        assert moved.files.read("/root/hello.txt") == b"from the source edge"
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
        _until(lambda: b.leftovers() == [], "the copy's files go with its last sandbox")

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
        _until(lambda: _staged(b) > 4 << 20 or not t.is_alive(), "the transfer started", 120)
        c.stop(a.proc, signal.SIGKILL)
        t.join(300)
        assert not t.is_alive()
        assert len(failure) == 1, f"the transfer was not cut off: {made}"
        assert isinstance(failure[0], errors.Unavailable), failure[0]
        assert a.id in str(failure[0])
        _until(lambda: b.leftovers() == [], "the partial copy removed")
        assert api.usage()["sandboxes"] == 0, api.usage()  # no admission kept
    finally:
        for s in (*made, src):
            try:
                s.kill()
            except errors.DsecError:
                pass


def _until(check: object, what: str, timeout_s: float = 30.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
