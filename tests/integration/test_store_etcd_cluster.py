"""A real 3-member etcd cluster on loopback with mutual TLS, and losing its leader."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core.errors import StoreUnavailable
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
