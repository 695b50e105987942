"""Two microVM edges (two sandboxes each) in separate processes on this machine (QEMU TCG),
for the cross-edge tests: snapshot copies (``test_snapshot_xedge``) and moves
(``test_sandbox_move``). A test module imports :func:`cluster` (its module fixture) and
starts from :func:`source_sandbox`."""

from __future__ import annotations

import contextlib
import os
import shutil
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


def _skip() -> str | None:
    why = microvm_skip_reason()
    if why:
        return why
    stamp = Paths.from_env().agent_bundle / ".stamp"
    return None if stamp.exists() else "no agent bundle: run `dsec setup`"


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


HELLO = b"from the source edge"  # /root/hello.txt in the source sandbox


@contextlib.contextmanager
def source_sandbox(
    api: Client, edges: list[Edge], *, fill_mb: int
) -> Iterator[tuple[Sandbox, Edge, Edge, list[Sandbox]]]:
    """A running microVM with :data:`HELLO` in ``/root/hello.txt``, a shell session
    ``work`` (``X=42``, in ``/tmp``) and ``fill_mb`` MiB of random data (zero pages are not
    sent) in ``/dev/shm/fill``. Yields it, its edge, the other edge and a list for the
    sandboxes the test makes; all of them are killed at the end."""
    a, b = edges
    src = Sandbox.create(backend="microvm", memory_mb=256, timeout=600, client=api)
    assert src.info().edge_id in (a.id, b.id)
    if src.info().edge_id == b.id:
        a, b = b, a
    made: list[Sandbox] = []
    try:
        src.files.write("/root/hello.txt", HELLO)
        src.shell("work").run("export X=42; cd /tmp")
        src.exec(f"head -c {fill_mb}M /dev/urandom > /dev/shm/fill", timeout=240)
        yield src, a, b, made
    finally:
        for s in (*made, src):
            with contextlib.suppress(errors.DsecError):
                s.kill()


def staged(edge: Edge) -> int:
    """Bytes staged by an import in progress on ``edge``."""
    n = 0
    for d in (edge.mem, edge.templates):
        for p in d.glob(".import-*/**/*" if d == edge.templates else ".import-*"):
            with contextlib.suppress(OSError):
                n += p.stat().st_blocks * 512 if p.is_file() else 0
    return n
