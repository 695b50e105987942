"""A cluster of separate processes on this machine: one iam, one watcher, two apiservers and
three edges that joined with bootstrap tokens (two on the fake backend, one real container
edge when this machine can run containers)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from dsec.core import errors
from dsec.sdk import Client, Sandbox
from dsec.testing.cluster import LocalCluster, local_cluster
from dsec.testing.platform import requirements_missing
from tests.waits import until

pytestmark = pytest.mark.timeout(300)
_REAL = requirements_missing()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with local_cluster(apiservers=2, health_timeout_s=6.0) as c:
        admin = Client(api_url=c.api_url(0), api_key=c.admin_key)
        backends = ["fake", "fake", "real" if _REAL is None else "fake"]
        for backend in backends:
            c.add_edge(admin.create_join_token(600)["token"], backend=backend)
        until(
            lambda: sum(bool(e["healthy"]) for e in admin.list_edges()) == 3,
            "three healthy edges",
            20,
        )
        admin.close()
        yield c


def test_a_used_or_forged_token_cannot_join(cluster: LocalCluster) -> None:
    admin = Client(api_url=cluster.api_url(1), api_key=cluster.admin_key)
    token = admin.create_join_token(60)["token"]
    cluster.add_edge(token)  # a fourth node joins ...
    with pytest.raises(RuntimeError, match="used"):
        cluster.add_edge(token)  # ... but not a fifth with the same token
    gone = cluster.edges[-1]
    cluster.stop(gone)
    gone.proc.wait(30)
    gone_id = (gone.home / "edge.id").read_text().strip()
    until(lambda: not next(
        e["healthy"] for e in admin.list_edges() if e["edge_id"] == gone_id),
        "the stopped edge is down", 20)  # fmt: skip
    with pytest.raises(errors.PermissionDenied):
        Client(api_url=cluster.api_url(0), api_key=_member_key(admin)).create_join_token(60)
    admin.close()


def _member_key(admin: Client) -> str:
    return admin.create_key("joiner", "default", "member", "").api_key


def test_scheduling_failover_and_revocation_across_apiservers(cluster: LocalCluster) -> None:
    a = Client(api_url=cluster.api_url(0), api_key=cluster.admin_key)
    b = Client(api_url=cluster.api_url(1), api_key=cluster.admin_key)
    # Spread: a burst of creates through both apiservers lands on every edge.
    made = [_create((a, b)[i % 2]) for i in range(9)]
    per_edge = {e: sum(1 for s in made if s["edge_id"] == e) for e in {s["edge_id"] for s in made}}
    assert len(per_edge) == 3, f"not spread over the three edges: {per_edge}"
    # Either apiserver serves any sandbox: the id names the edge.
    for s in made:
        assert b.get_sandbox(s["id"]).edge_id == s["edge_id"]
        assert a.get_sandbox(s["id"]).id == s["id"]
    # A silent edge (stopped, not dead) is marked down by the watcher and not scheduled.
    silent = next(e for e in cluster.edges[:2])
    silent_id = (silent.home / "edge.id").read_text().strip()
    silent.proc.send_signal(signal.SIGSTOP)
    try:
        took = until(
            lambda: any(e["edge_id"] == silent_id and not e["healthy"] for e in a.list_edges()),
            "the watcher marks the silent edge down",
            30,
        )
        assert took < 20  # the health timeout (6 s) and a sweep
        later = [_create((a, b)[i % 2]) for i in range(6)]
        assert silent_id not in {s["edge_id"] for s in later}
        made += later
    finally:
        silent.proc.send_signal(signal.SIGCONT)
    until(
        lambda: any(e["edge_id"] == silent_id and e["healthy"] for e in a.list_edges()),
        "the edge is back",
        20,
    )
    # A key revoked through one apiserver is refused by the other within a few seconds.
    key = a.create_key("rev", "default", "member", "revocation test")
    user = Client(api_url=cluster.api_url(1), api_key=key.api_key)
    assert user.whoami().subject == "rev"
    token = user.create_token(300)
    with_token = Client(api_url=cluster.api_url(1), api_key=token.token)
    assert with_token.whoami().subject == "rev"
    a.revoke("subject", "rev")
    took = until(lambda: _refused(with_token), "apiserver B refuses the revoked token", 10)
    assert took < 5
    until(lambda: _refused(user), "apiserver B refuses the revoked key", 10)
    for s in made:
        _kill_retrying((a, b)[hash(s["id"]) % 2], s["id"])
    for c in (a, b, user, with_token):
        c.close()


def _create(client: Client) -> dict[str, str]:
    s = Sandbox.create(memory_mb=64, cpu=0.1, timeout=300, client=client)
    info = s.info()
    return {"id": s.id, "edge_id": info.edge_id}


def _refused(client: Client) -> bool:
    try:
        client.whoami()
    except errors.Unauthenticated:
        return True
    return False


def _kill_retrying(client: Client, sandbox_id: str) -> None:
    """Clean-up kill: on a loaded machine an edge can miss its 3 s health window for a moment."""
    deadline = time.monotonic() + 30
    while True:
        try:
            client.kill_sandbox(sandbox_id)
            return
        except errors.Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
