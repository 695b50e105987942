"""The trajectory log checks on a real etcd (step metadata in etcd, payloads over 64 KiB
as content-addressed files beside it)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.store.etcd import EtcdStore
from dsec.testing.etcd import EtcdCluster, etcd_binary, etcd_cluster
from dsec.testing.trajectory_checks import CHECKS
from dsec.trajectory.blobs import FileBlobStore
from dsec.trajectory.log import TrajectoryLog

pytestmark = pytest.mark.skipif(
    etcd_binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server)"
)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with etcd_cluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest_asyncio.fixture
async def tlog(etcd: EtcdCluster, tmp_path: Path) -> AsyncIterator[TrajectoryLog]:
    store = EtcdStore(etcd.endpoints, retry_s=5.0)
    yield TrajectoryLog(store, FileBlobStore(tmp_path / "blobs"))
    await store.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(CHECKS))
async def test_log_on_etcd(tlog: TrajectoryLog, name: str) -> None:
    await CHECKS[name](tlog, f"team/{secrets.token_hex(3)}")
