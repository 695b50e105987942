"""A real 3-member etcd cluster on loopback with mutual TLS, and losing its leader."""

from __future__ import annotations

import asyncio
import secrets
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core import errors
from dsec.core.errors import StoreUnavailable
from dsec.core.ids import new_sandbox_id
from dsec.iam.app import IamApp, IamConfig
from dsec.iam.kv import KvIam
from dsec.iam.records import Admission, Project
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.tls import ensure_node_pki
from dsec.store.api import Compare, EventType, Op, Put, StateStore, Target, WatchBatch
from dsec.store.etcd import EtcdStore, EtcdTls
from dsec.testing.etcd import EtcdCluster, etcd_binary, etcd_cluster, make_test_pki
from dsec.testing.store_checks import CHECKS, admit_many

pytestmark = [
    pytest.mark.skipif(
        etcd_binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server)"
    ),
    pytest.mark.timeout(180),
]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    with etcd_cluster(tmp_path / "etcd", size=3, tls=True) as c:
        yield c


def _sid(n: int) -> str:
    return new_sandbox_id("e0a1", n.to_bytes(13, "little"))


def _leader_first(cluster: EtcdCluster) -> list[str]:
    leader = cluster.wait_leader()
    return [leader.endpoint] + [e for e in cluster.endpoints if e != leader.endpoint]


@pytest_asyncio.fixture
async def store(cluster: EtcdCluster) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(_leader_first(cluster), tls=cluster.client_tls(), retry_s=20.0)
    yield s
    await s.aclose()


@pytest.mark.asyncio
async def test_conformance_over_mtls(store: EtcdStore) -> None:
    for name in ("revisions", "txn", "watch", "leases", "limits"):
        await CHECKS[name](store, b"/tls/%s/" % name.encode())


@pytest.mark.asyncio
async def test_client_without_the_cluster_ca_is_refused(cluster: EtcdCluster, tmp_path: Path):
    other = make_test_pki(tmp_path / "other").client_tls()
    no_cert = EtcdTls(cluster.client_tls().ca)  # type: ignore[union-attr]
    for tls in (other, no_cert):
        s = EtcdStore(cluster.endpoints, tls=tls, timeout_s=1.0, retry_s=1.0)
        try:
            with pytest.raises(StoreUnavailable):
                await s.put(b"/refused", b"x")
        finally:
            await s.aclose()


async def _create(store: StateStore, key: bytes) -> None:
    """Create ``key``; a write that may or may not have applied is retried (it is idempotent)."""
    for _ in range(10):
        try:
            await store.txn([Compare(key, Target.CREATE, Op.EQ, 0)], [Put(key, b"x")])
            return
        except StoreUnavailable:
            continue
    raise AssertionError(f"could not create {key!r}")


@pytest.mark.asyncio
async def test_watch_resumes_after_its_member_is_killed(cluster: EtcdCluster, store: EtcdStore):
    prefix = b"/resume/"
    first = await store.put(prefix + b"0", b"0")
    seen: list[WatchBatch] = []
    async with aclosing(store.watch(prefix, start_revision=first)) as w:
        seen.append(await asyncio.wait_for(anext(w), 10))
        leader = cluster.wait_leader()
        await asyncio.to_thread(cluster.kill, leader)  # the watch and the client were on it
        for i in range(1, 6):
            await _create(store, prefix + b"%d" % i)
        while len(seen) < 6:
            seen.append(await asyncio.wait_for(anext(w), 30))
    keys = [e.kv.key for b in seen for e in b.events]
    assert keys == [prefix + b"%d" % i for i in range(6)]
    assert all(e.type is EventType.PUT for b in seen for e in b.events)
    revs = [b.revision for b in seen]
    assert revs == sorted(set(revs))


@pytest.mark.asyncio
async def test_admission_is_exact_while_the_leader_is_killed(cluster: EtcdCluster) -> None:
    endpoints = _leader_first(cluster)
    tls = cluster.client_tls()
    stores: list[StateStore] = [
        EtcdStore(endpoints[i:] + endpoints[:i], tls=tls, retry_s=30.0) for i in range(3)
    ]
    prefix = b"/quota/%s/" % secrets.token_hex(4).encode()
    killed = asyncio.Event()

    async def kill_leader_mid_way() -> None:
        while (await stores[0].range(prefix, limit=1)).count < 110:
            await asyncio.sleep(0.01)
        leader = cluster.wait_leader()
        await asyncio.to_thread(cluster.kill, leader)
        killed.set()

    killer = asyncio.create_task(kill_leader_mid_way())
    try:
        admitted = await admit_many(stores, prefix, attempts=500, quota=310, used=10)
        assert killed.is_set(), "the leader was not killed during the admissions"
        assert admitted == 300
        assert (await stores[1].range(prefix)).count == 310
    finally:
        killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
        for s in stores:
            await s.aclose()


@pytest.mark.asyncio
async def test_iam_admission_is_exact_while_the_leader_is_killed(cluster: EtcdCluster) -> None:
    """Three iam state clients (as three iam processes would be) on the 3-member cluster:
    500 concurrent creates against a subtree quota of 300 admit exactly 300, though the
    leader dies part way, and the audit chain they share still verifies."""
    endpoints = _leader_first(cluster)
    tls = cluster.client_tls()
    stores = [EtcdStore(endpoints[i:] + endpoints[:i], tls=tls, retry_s=30.0) for i in range(3)]
    iams = [KvIam(s, retry_s=60.0) for s in stores]
    await iams[0].put_project(Project("big", 300, 0, 0))
    for child in ("big/a", "big/b"):
        await iams[1].put_project(Project(child, 0, 0, 0))
    batch = [Admission("big/a" if i % 2 else "big/b", _sid(i), 0.1, 10) for i in range(500)]
    chunks = [batch[i : i + 20] for i in range(0, len(batch), 20)]
    killed = asyncio.Event()

    async def kill_leader_mid_way() -> None:
        while (await iams[2].usage("big")).sandboxes < 100:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(cluster.kill, cluster.wait_leader())
        killed.set()

    killer = asyncio.create_task(kill_leader_mid_way())
    try:
        results = await asyncio.gather(
            *(iams[n % 3].admit_many(chunk) for n, chunk in enumerate(chunks))
        )
        flat = [r for rs in results for r in rs]
        assert killed.is_set(), "the leader was not killed during the admissions"
        assert sum(isinstance(r, bool) for r in flat) == 300
        assert sum(isinstance(r, errors.QuotaExceeded) for r in flat) == 200
        assert (await iams[1].usage("big")).sandboxes == 300
        assert len(await iams[2].allocations()) == 300
        count, broken, _ = await iams[0].verify_audit()
        assert (count, broken) == (3, None)
    finally:
        killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
        for s in stores:
            await s.aclose()


@pytest.mark.asyncio
async def test_two_iam_daemons_share_one_etcd_state(cluster: EtcdCluster, tmp_path: Path):
    """`python -m dsec.iam --store etcd://...`: two daemons bootstrap once; a key made on one
    authenticates on the other, and a revocation on one is in the other's feed."""
    assert cluster.pki is not None
    tls_dir = tmp_path / "etcd-tls"
    tls_dir.mkdir()
    for name, src in (("ca.pem", cluster.pki.ca), ("client.pem", cluster.pki.client_cert),
                      ("client-key.pem", cluster.pki.client_key)):  # fmt: skip
        (tls_dir / name).write_bytes(src.read_bytes())
    url = "etcd://" + ",".join(cluster.endpoints)
    homes = [tmp_path / "iam0", tmp_path / "iam1"]
    ensure_node_pki(homes[0])  # one CA and one token-signing key for both daemons
    apps = []
    for home in homes:
        if home != homes[0]:
            shutil.copytree(homes[0] / "pki", home / "pki")
        app = IamApp(IamConfig(home, listen="127.0.0.1:0", metrics_listen="", store=url,
                               etcd_tls_dir=tls_dir))  # fmt: skip
        await app.start()
        apps.append(app)
    try:
        assert sum((h / "admin.key").exists() for h in homes) == 1, "bootstrapped twice"
        channels = [secure_channel(h / "pki", "admin", f"127.0.0.1:{a.port}", component="iam")
                    for h, a in zip(homes, apps, strict=True)]  # fmt: skip
        s0, s1 = (pb_grpc.IamStub(c) for c in channels)
        await s0.PutProject(pb.Project(name="team", max_sandboxes=2), timeout=10)
        made = await s0.CreateKey(
            pb.CreateKeyRequest(subject="alice", project="team", role="member"), timeout=10
        )
        p = await s1.Authenticate(pb.AuthenticateRequest(api_key=made.api_key), timeout=10)
        assert (p.subject, p.project) == ("alice", "team")
        await s1.Revoke(pb.RevokeRequest(kind="key", value=made.key_id), timeout=10)
        feed = await s0.Revocations(pb.RevocationsRequest(after_seq=0), timeout=10)
        assert [(r.kind, r.value) for r in feed.entries] == [("key", made.key_id)]
        with pytest.raises(errors.Unauthenticated):
            await s0.Authenticate(pb.AuthenticateRequest(api_key=made.api_key), timeout=10)
        for c in channels:
            await c.close()
    finally:
        for app in apps:
            await app.stop()
