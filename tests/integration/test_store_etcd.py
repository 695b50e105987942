"""The state store conformance suite on a real single-member etcd on loopback."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from dsec.core.errors import StoreUnavailable
from dsec.store.etcd import EtcdStore
from dsec.testing.etcd import EtcdCluster, etcd_binary, etcd_cluster
from dsec.testing.ports import free_port
from dsec.testing.store_checks import CHECKS

pytestmark = pytest.mark.skipif(
    etcd_binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server)"
)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with etcd_cluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest_asyncio.fixture
async def store(etcd: EtcdCluster) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(etcd.endpoints, retry_s=5.0)
    yield s
    await s.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(CHECKS))
async def test_conformance(store: EtcdStore, name: str) -> None:
    await CHECKS[name](store, b"/t/%s/" % secrets.token_hex(4).encode())


@pytest.mark.asyncio
async def test_unreachable_etcd_is_store_unavailable() -> None:
    s = EtcdStore([f"127.0.0.1:{free_port()}"], timeout_s=0.5, retry_s=0.5)
    try:
        with pytest.raises(StoreUnavailable):
            await s.get(b"k")
        with pytest.raises(StoreUnavailable):
            await s.put(b"k", b"v")
    finally:
        await s.aclose()
