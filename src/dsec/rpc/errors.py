"""One table between :mod:`dsec.core.errors` and gRPC status codes, for both directions.

A server turns a :class:`~dsec.core.errors.DsecError` into the status of :data:`STATUS_BY_CODE`
and puts the exact error code in the trailing metadata key ``x-dsec-code``; the client
rebuilds the same class from that key (:func:`error_from_rpc`). A status without the key
came from gRPC itself or a foreign peer and maps to the generic class of
:data:`ERROR_BY_STATUS` (``UNAVAILABLE`` becomes :class:`~dsec.core.errors.Unavailable`
naming the component that could not be reached).

Error classes added later that are not in the table take the status of their nearest
listed ancestor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from dsec.core import errors as e

CODE_KEY = "x-dsec-code"

STATUS_BY_CODE: dict[str, grpc.StatusCode] = {
    e.DsecError.code: grpc.StatusCode.INTERNAL,
    e.ClientError.code: grpc.StatusCode.FAILED_PRECONDITION,
    e.InvalidArgument.code: grpc.StatusCode.INVALID_ARGUMENT,
    e.PathOutsideSandbox.code: grpc.StatusCode.INVALID_ARGUMENT,
    e.Unauthenticated.code: grpc.StatusCode.UNAUTHENTICATED,
    e.PermissionDenied.code: grpc.StatusCode.PERMISSION_DENIED,
    e.NotFound.code: grpc.StatusCode.NOT_FOUND,
    e.SandboxNotFound.code: grpc.StatusCode.NOT_FOUND,
    e.ImageNotFound.code: grpc.StatusCode.NOT_FOUND,
    e.ProcessNotFound.code: grpc.StatusCode.NOT_FOUND,
    e.InvalidState.code: grpc.StatusCode.FAILED_PRECONDITION,
    e.AlreadyExists.code: grpc.StatusCode.ALREADY_EXISTS,
    e.PayloadTooLarge.code: grpc.StatusCode.OUT_OF_RANGE,
    e.QuotaExceeded.code: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.BackendUnavailable.code: grpc.StatusCode.FAILED_PRECONDITION,
    e.ServerError.code: grpc.StatusCode.INTERNAL,
    e.Internal.code: grpc.StatusCode.INTERNAL,
    e.SandboxFailed.code: grpc.StatusCode.INTERNAL,
    e.Unavailable.code: grpc.StatusCode.UNAVAILABLE,
    e.NodeFull.code: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.DeadlineExceeded.code: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# For statuses that arrive without x-dsec-code (raised by gRPC itself or a foreign peer).
# gRPC answers RESOURCE_EXHAUSTED on its own only for over-size messages.
ERROR_BY_STATUS: dict[grpc.StatusCode, type[e.DsecError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: e.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: e.InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: e.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: e.PermissionDenied,
    grpc.StatusCode.NOT_FOUND: e.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: e.InvalidState,
    grpc.StatusCode.ALREADY_EXISTS: e.AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: e.PayloadTooLarge,
    grpc.StatusCode.UNAVAILABLE: e.Unavailable,
    grpc.StatusCode.CANCELLED: e.Unavailable,
    grpc.StatusCode.ABORTED: e.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: e.DeadlineExceeded,
}


def status_for(err: e.DsecError) -> grpc.StatusCode:
    """The gRPC status for ``err``: its own entry, else its nearest listed ancestor's."""
    for cls in type(err).__mro__:
        code = getattr(cls, "code", None)
        if isinstance(code, str) and issubclass(cls, e.DsecError) and code in STATUS_BY_CODE:
            return STATUS_BY_CODE[code]
    return grpc.StatusCode.INTERNAL


def trailers_for(err: e.DsecError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries ``err``'s exact code to the peer."""
    return ((CODE_KEY, err.code),)


def error_from_status(
    status: grpc.StatusCode,
    details: str,
    trailing: tuple[tuple[str, str | bytes], ...] | None,
    component: str,
) -> e.DsecError:
    """Rebuild the DsecError a peer raised from a status, its details and trailers.

    Args:
        status: the call's status code (not OK).
        details: the status message (the DsecError's message when it came from us).
        trailing: the trailing metadata; ``x-dsec-code`` there names the exact class.
        component: who was called (e.g. ``"iam"``), named in messages of transport errors.
    """
    for key, value in trailing or ():
        if key == CODE_KEY:
            code = value.decode() if isinstance(value, bytes) else value
            return e.error_from_wire(code, details)
    if status == grpc.StatusCode.UNAVAILABLE:
        return e.Unavailable(f"{component} is unavailable: {details}")
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return e.DeadlineExceeded(f"{component} did not answer in time: {details}")
    cls = ERROR_BY_STATUS.get(status, e.Internal)
    return cls(f"{component}: {status.name.lower()}: {details}")


def error_from_rpc(err: grpc.aio.AioRpcError, component: str) -> e.DsecError:
    """Translate a failed call into the DsecError the server raised (or the closest one)."""
    trailing = err.trailing_metadata()
    pairs = tuple((str(k), v) for k, v in trailing) if trailing else None
    return error_from_status(err.code(), err.details() or "", pairs, component)


translate_rpc_error = error_from_rpc  # the name callers elsewhere use


@asynccontextmanager
async def translated(component: str) -> AsyncIterator[None]:
    """Re-raise ``grpc.aio.AioRpcError`` inside the block as the matching DsecError.

    Unary calls made on :func:`dsec.rpc.client.secure_channel` are translated already; use
    this around streaming calls::

        async with translated("edge"):
            async for frame in stub.Stream(frames()):
                ...
    """
    try:
        yield
    except grpc.aio.AioRpcError as err:
        raise error_from_rpc(err, component) from err
