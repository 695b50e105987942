"""The DsecError <-> gRPC status table (without a network; see integration for the wire)."""

from __future__ import annotations

import grpc
import pytest

from dsec.core import errors as e
from dsec.core.errors import ERRORS_BY_CODE
from dsec.rpc.errors import (
    CODE_KEY,
    ERROR_BY_STATUS,
    STATUS_BY_CODE,
    error_from_status,
    status_for,
    trailers_for,
)


@pytest.mark.parametrize("cls", [ERRORS_BY_CODE[c] for c in sorted(ERRORS_BY_CODE)])
def test_every_error_round_trips(cls: type[e.DsecError]) -> None:
    err = cls("something went wrong: ünïcode")
    status = status_for(err)
    assert status != grpc.StatusCode.OK
    back = error_from_status(status, err.message, trailers_for(err), "peer")
    assert type(back) is cls
    assert back.message == err.message


def test_table_names_only_real_codes() -> None:
    # Classes added later may be missing (they take their ancestor's status), never extra.
    assert set(STATUS_BY_CODE) <= set(ERRORS_BY_CODE)
    assert len(STATUS_BY_CODE) >= 20


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (e.NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (e.SandboxNotFound("x"), grpc.StatusCode.NOT_FOUND),
        (e.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (e.PathOutsideSandbox("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (e.Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
        (e.PermissionDenied("x"), grpc.StatusCode.PERMISSION_DENIED),
        (e.InvalidState("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (e.AlreadyExists("x"), grpc.StatusCode.ALREADY_EXISTS),
        (e.QuotaExceeded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (e.NodeFull("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (e.Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (e.DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (e.Internal("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_of_each_class(err: e.DsecError, status: grpc.StatusCode) -> None:
    assert status_for(err) == status


def test_unlisted_subclass_takes_its_ancestors_status() -> None:
    class TokenRevoked(e.Unauthenticated):
        code = "token_revoked_test_only"

    assert status_for(TokenRevoked("x")) == grpc.StatusCode.UNAUTHENTICATED


def test_statuses_without_code_map_to_generic_classes() -> None:
    for status, cls in ERROR_BY_STATUS.items():
        got = error_from_status(status, "details", None, "edge")
        assert isinstance(got, cls), status
    unknown = error_from_status(grpc.StatusCode.UNKNOWN, "boom", (), "edge")
    assert type(unknown) is e.Internal


def test_unavailable_names_the_component() -> None:
    got = error_from_status(grpc.StatusCode.UNAVAILABLE, "connection refused", (), "iam (x:1)")
    assert type(got) is e.Unavailable
    assert "iam (x:1)" in got.message
    assert "connection refused" in got.message


def test_unknown_code_from_a_newer_peer_is_internal() -> None:
    got = error_from_status(
        grpc.StatusCode.NOT_FOUND, "m", ((CODE_KEY, b"from_the_future"),), "edge"
    )
    assert type(got) is e.Internal
    assert "from_the_future" in got.message
