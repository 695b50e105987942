"""etcd statuses become our errors in one place, and only safe writes are retried."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from dsec.core import errors as e
from dsec.store.etcd import _not_applied, translate


def rpc_error(code: grpc.StatusCode, details: str) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details)


@pytest.mark.parametrize(
    ("code", "details", "want"),
    [
        (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found", e.LeaseNotFound),
        (
            grpc.StatusCode.OUT_OF_RANGE,
            "etcdserver: mvcc: required revision has been compacted",
            e.Compacted,
        ),
        (
            grpc.StatusCode.OUT_OF_RANGE,
            "etcdserver: mvcc: required revision is a future revision",
            e.InvalidArgument,
        ),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "etcdserver: too many operations in txn request",
            e.TxnTooLarge,
        ),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large", e.ValueTooLarge),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "etcdserver: duplicate key given in txn request",
            e.InvalidArgument,
        ),
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader", e.StoreUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", e.StoreUnavailable),
        (grpc.StatusCode.UNKNOWN, "etcdserver: leader changed", e.StoreUnavailable),
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", e.Internal),
    ],
)
def test_translate(code: grpc.StatusCode, details: str, want: type[e.DsecError]) -> None:
    assert type(translate(rpc_error(code, details))) is want


def test_only_provably_unsent_writes_are_retried() -> None:
    assert _not_applied(rpc_error(grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader"))
    assert _not_applied(
        rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error")
    )
    assert not _not_applied(rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert not _not_applied(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert not _not_applied(rpc_error(grpc.StatusCode.UNKNOWN, "etcdserver: leader changed"))
