"""The create path across separate processes (iam, watcher, apiserver, three fake-backend
edges that joined with bootstrap tokens), with creates on the apiserver's kept streams to
the edges: a full edge has the final say and the sandbox goes elsewhere; an edge that dies
with creates in flight fails them and they go elsewhere; nothing is double-counted; the
stream comes back with the edge."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from dsec.sdk import Client, Sandbox
from dsec.testing.cluster import LocalCluster, Proc, local_cluster
from tests.waits import until

pytestmark = pytest.mark.timeout(300)


def _edge_id(p: Proc) -> str:
    return (p.home / "edge.id").read_text().strip()


def _elsewhere(cluster: LocalCluster, code: str) -> float:
    """How often the apiserver moved a create on because an edge answered ``code``."""
    text = httpx.get(f"{cluster.api_url(0)}/metrics", timeout=10).text
    key = f'dsec_apiserver_create_edge_unavailable_total{{code="{code}"}} '
    return sum(float(line.removeprefix(key)) for line in text.splitlines() if line.startswith(key))


def _healthy(admin: Client, edge_id: str) -> bool:
    return any(e["edge_id"] == edge_id and e["healthy"] for e in admin.list_edges())


def test_full_or_dead_edges_send_creates_elsewhere_once_each() -> None:
    with local_cluster(apiservers=1, health_timeout_s=6.0) as cluster:
        admin = Client(api_url=cluster.api_url(0), api_key=cluster.admin_key)
        small = cluster.add_edge(admin.create_join_token(600)["token"],
                                 extra=["--max-sandboxes", "1"])  # fmt: skip
        big = cluster.add_edge(admin.create_join_token(600)["token"])
        doomed = cluster.add_edge(admin.create_join_token(600)["token"])
        ids = {_edge_id(p) for p in (small, big, doomed)}
        until(lambda: all(_healthy(admin, e) for e in ids), "three healthy edges", 30)
        base = admin.usage()["sandboxes"]

        # The small edge takes one sandbox; then, emptiest by the reports, it is asked first
        # and answers node full: the sandbox is placed on the next edge.
        made = [Sandbox.create(memory_mb=64, cpu=0.1, timeout=300, client=admin)
                for _ in range(8)]  # fmt: skip
        on = [s.info().edge_id for s in made]
        assert on.count(_edge_id(small)) == 1, on
        assert _elsewhere(cluster, "node_full") >= 1
        assert admin.usage()["sandboxes"] == base + 8  # the refused admissions were released
        for s in made:
            s.kill()
        until(lambda: admin.usage()["sandboxes"] == base, "the kills released", 30)

        # An edge stops answering with creates on their way to it, then dies: each of them
        # fails there once and is placed elsewhere.
        doomed.proc.send_signal(signal.SIGSTOP)
        got: list[str] = []
        errors: list[BaseException] = []

        def creates() -> None:
            with Client(api_url=cluster.api_url(0), api_key=cluster.admin_key) as c:
                for _ in range(3):
                    try:
                        s = Sandbox.create(memory_mb=64, cpu=0.1, timeout=300, client=c)
                        got.append(s.info().edge_id)
                    except BaseException as exc:
                        errors.append(exc)

        threads = [threading.Thread(target=creates) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(30)
        for t in threads:
            t.join(120)
        assert errors == []
        assert len(got) == 12, got
        assert _edge_id(doomed) not in got, got
        assert _elsewhere(cluster, "unavailable") >= 1  # some were in flight to it
        assert admin.usage()["sandboxes"] == base + 12  # each counted once
        until(lambda: not _healthy(admin, _edge_id(doomed)), "the dead edge is down", 30)
        live = {s.id for s in admin.list_sandboxes()}
        assert len(live) == 12

        # The edge comes back at its address: the apiserver's stream to it comes back too.
        back = cluster.restart(doomed)
        until(lambda: _healthy(admin, _edge_id(back)), "the edge is back", 30)
        landed: list[str] = []

        def lands_there() -> bool:  # emptiest, it is picked first once its channel reconnects
            s = Sandbox.create(memory_mb=64, cpu=0.1, timeout=300, client=admin)
            live.add(s.id)
            landed.append(s.info().edge_id)
            if landed[-1] == _edge_id(back):
                return True
            time.sleep(1)
            return False

        # (gRPC retries a lost peer with exponential backoff, as for unary calls: the first
        # creates after it is back may still find its channel waiting and go elsewhere)
        until(lands_there, "a create on the edge that came back", 90)
        for sid in live:
            admin.kill_sandbox(sid)
        admin.close()
