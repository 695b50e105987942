"""A paused microVM resumes on another edge (two edge processes on this machine, QEMU TCG,
as in ``test_snapshot_xedge``): it moves under a new id with its processes, shell sessions,
files and ``/dev/shm``; the old id answers with the new one; quota counts it once
throughout. Refused moves (target full, a digest mismatch) leave it paused and resumable on
its own edge. A paused sandbox forks onto another edge. A second create from the same
snapshot on another edge sends nothing but the manifest (the target keeps the first copy by
digest), and deleting the snapshot drops that cache."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest

from dsec.core import errors
from dsec.sdk import Client, Sandbox
from dsec.testing.cluster import LocalCluster
from tests.integration.xedge import HELLO, Edge, cluster, source_sandbox, staged
from tests.waits import until

pytestmark = [pytest.mark.guest_kernel, pytest.mark.timeout(900)]
__all__ = ["cluster"]  # the two-edge fixture


def _copied_bytes(c: LocalCluster) -> int:
    """Snapshot bytes the apiserver has passed from one edge to another so far."""
    with urllib.request.urlopen(c.api_url(0) + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^dsec_apiserver_snapshot_copy_bytes_total (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def _sandbox_dir(edge: Edge, sid: str) -> Path:
    return edge.home / "edge" / "sandboxes" / sid


def _flip(p: Path, at: int = 4096) -> None:
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_resume_on_another_edge_fork_when_paused_and_cached_copies(
    cluster: tuple[LocalCluster, Client, list[Edge]],
) -> None:
    c, api, edges = cluster
    with source_sandbox(api, edges, fill_mb=8) as (src, a, b, made):
        sleeper = src.processes.start(["sleep", "4242"])

        # a snapshot started twice on the other edge: the second copy sends no chunk
        snap = src.snapshot("warm")
        before = _copied_bytes(c)
        t0 = time.monotonic()
        first = Sandbox.from_snapshot(snap.id, edge=b.id, timeout=300, client=api)
        made.append(first)
        first.exec("true")
        t_first = time.monotonic() - t0
        sent = _copied_bytes(c) - before
        assert sent > 8 << 20, sent
        assert list(b.mem.glob("cache-*.mem")), "the RAM file is kept on the target"
        t0 = time.monotonic()
        second = Sandbox.from_snapshot(snap.id, edge=b.id, timeout=300, client=api)
        made.append(second)
        second.exec("true")
        t_cached = time.monotonic() - t0
        assert _copied_bytes(c) - before == sent, "the second copy sent file data"
        assert second.files.read("/root/hello.txt") == HELLO
        assert second.shell("work").run("echo $X").stdout.strip() == "42"
        print(f"from_snapshot on another edge: first {t_first:.1f} s, cached {t_cached:.1f} s")

        # b is full now (two sandboxes): moving there is refused, the sandbox stays paused
        usage = api.usage()["sandboxes"]
        old = src.id
        src.pause()
        with pytest.raises(errors.NodeFull):
            src.resume(edge=b.id)
        assert src.id == old
        assert src.info().state == "paused"
        assert staged(b) == 0
        assert api.usage()["sandboxes"] == usage
        first.kill()
        second.kill()
        usage -= 2
        until(lambda: api.usage()["sandboxes"] == usage, "the two released", 30)
        api.delete_snapshot(snap.id)
        until(lambda: not list(b.mem.glob("cache-*")), "the deleted snapshot's cache dropped", 30)

        # a paused sandbox forks onto another edge (its pause snapshot is copied)
        kid = src.fork(1, edge=b.id)[0]
        made.append(kid)
        assert kid.info().edge_id == b.id
        assert kid.shell("work").run("echo $X").stdout.strip() == "42"
        kid.kill()
        assert src.info().state == "paused"

        # a pause snapshot changed since it was written is refused; nothing half-restored
        state = _sandbox_dir(a, old) / "snapshots" / "current" / "state"
        _flip(state)
        with pytest.raises(errors.SandboxFailed, match="does not match its digest"):
            src.resume(edge=b.id)
        _flip(state)
        assert src.id == old
        assert src.info().state == "paused"
        until(lambda: b.leftovers() == [], "nothing of the refused move on the target", 30)
        assert api.usage()["sandboxes"] == usage

        # the move: a new id on b, everything carries on
        t0 = time.monotonic()
        info = src.resume(edge=b.id)
        took = time.monotonic() - t0
        print(f"resume on another edge: {took:.1f} s")
        assert info.id == src.id != old
        assert info.edge_id == b.id
        assert info.state == "running"
        assert src.files.read("/root/hello.txt") == HELLO
        work = src.shell("work")
        assert work.run("echo $X").stdout.strip() == "42"
        assert work.run("pwd").stdout.strip() == "/tmp"
        assert src.exec("stat -c %s /dev/shm/fill").stdout.strip() == str(8 << 20)
        running = {p.pid for p in src.processes.list() if p.running}
        assert sleeper.pid in running
        assert api.usage()["sandboxes"] == usage  # counted once, never twice
        with pytest.raises(errors.SandboxNotFound, match=f"moved to another edge as {src.id}"):
            api.get_sandbox(old)
        with pytest.raises(errors.SandboxNotFound, match=src.id):
            Sandbox(old, api).exec("true")
        assert not _sandbox_dir(a, old).exists()
        assert not list(b.mem.glob("cache-*"))  # a move (and a paused fork) caches nothing
        assert not list(a.mem.glob(f"{old}*"))

        # a paused sandbox whose pause snapshot is gone: a clear error, it stays
        src.pause()
        moved_id = src.id
        (_sandbox_dir(b, moved_id) / "snapshots" / "current" / "manifest.json").unlink()
        with pytest.raises(errors.SnapshotNotFound, match=r"pause snapshot .* is gone"):
            src.resume(edge=a.id)
        assert src.id == moved_id
        assert src.info().state == "paused"
        src.kill()
        until(lambda: a.leftovers() == [] and b.leftovers() == [], "every file removed", 30)
        until(lambda: api.usage()["sandboxes"] == usage - 1, "the moved sandbox released", 30)
