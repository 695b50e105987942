"""The one exception tree of OpenDsec.

Every error a component raises on purpose derives from :class:`DsecError`. Each class names
the fault, carries a stable wire ``code`` and the HTTP status the public API answers with;
``dsec.rpc.errors`` maps the same codes to gRPC statuses, so an error crosses every hop
(aether -> edge -> apiserver -> SDK) as the same class::

    DsecError                       500 error (abstract base)
    ├── ClientError                 the caller is at fault (4xx)
    │   ├── InvalidArgument         400 invalid_argument
    │   │   ├── PathOutsideSandbox  400 path_outside_sandbox
    │   │   └── TxnTooLarge         400 txn_too_large
    │   ├── Unauthenticated         401 unauthenticated
    │   ├── PermissionDenied        403 permission_denied
    │   ├── NotFound                404 not_found
    │   │   ├── SandboxNotFound     404 sandbox_not_found
    │   │   ├── SnapshotNotFound    404 snapshot_not_found
    │   │   ├── ImageNotFound       404 image_not_found
    │   │   ├── ProcessNotFound     404 process_not_found
    │   │   └── LeaseNotFound       404 lease_not_found
    │   ├── InvalidState            409 invalid_state
    │   │   ├── TrajectoryMismatch  409 trajectory_mismatch
    │   │   ├── TrajectoryBound     409 trajectory_bound
    │   │   └── NotRestorable       409 trajectory_not_restorable
    │   ├── AlreadyExists           409 already_exists
    │   ├── Compacted               410 compacted
    │   ├── PayloadTooLarge         413 payload_too_large
    │   │   └── ValueTooLarge       413 value_too_large
    │   ├── QuotaExceeded           429 quota_exceeded
    │   └── BackendUnavailable      422 backend_unavailable
    └── ServerError                 the platform or a peer is at fault (5xx)
        ├── Internal                500 internal
        ├── SandboxFailed           500 sandbox_failed
        ├── Unavailable             503 unavailable
        │   ├── NodeFull            503 node_full
        │   └── StoreUnavailable    503 store_unavailable
        └── DeadlineExceeded        504 deadline_exceeded
"""

from __future__ import annotations

from typing import ClassVar


class DsecError(Exception):
    """Base of every OpenDsec error; ``code`` and ``http_status`` travel on the wire."""

    code: ClassVar[str] = "error"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class ClientError(DsecError):
    """The request was wrong; retrying it unchanged will fail again."""

    code = "client_error"
    http_status = 400


class InvalidArgument(ClientError):
    code = "invalid_argument"
    http_status = 400


class PathOutsideSandbox(InvalidArgument):
    """A path (or a symlink on it) leads outside the sandbox's root."""

    code = "path_outside_sandbox"


class TxnTooLarge(InvalidArgument):
    """A store transaction has more compares or ops than the store accepts (128 per list)."""

    code = "txn_too_large"


class Unauthenticated(ClientError):
    code = "unauthenticated"
    http_status = 401


class PermissionDenied(ClientError):
    code = "permission_denied"
    http_status = 403


class NotFound(ClientError):
    code = "not_found"
    http_status = 404


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


class SnapshotNotFound(NotFound):
    code = "snapshot_not_found"


class LeaseNotFound(NotFound):
    """The store lease does not exist (never granted, revoked or expired)."""

    code = "lease_not_found"


class ImageNotFound(NotFound):
    code = "image_not_found"


class ProcessNotFound(NotFound):
    code = "process_not_found"


class InvalidState(ClientError):
    """The operation is not allowed in the object's current lifecycle state."""

    code = "invalid_state"
    http_status = 409


class TrajectoryMismatch(InvalidState):
    """A replayed call differs from the recorded step and the policy is ``fail``."""

    code = "trajectory_mismatch"


class TrajectoryBound(InvalidState):
    """A call was sent as for a sandbox bound to no trajectory, and the sandbox is bound
    (the apiserver looks the binding up again and records the call)."""

    code = "trajectory_bound"


class NotRestorable(InvalidState):
    """A trajectory's sandbox is gone and its state cannot be rebuilt safely."""

    code = "trajectory_not_restorable"


class AlreadyExists(ClientError):
    code = "already_exists"
    http_status = 409


class PayloadTooLarge(ClientError):
    code = "payload_too_large"
    http_status = 413


class Compacted(ClientError):
    """The requested store revision is older than the compaction point: list, then watch."""

    code = "compacted"
    http_status = 410

    def __init__(self, message: str, compact_revision: int = 0) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class ValueTooLarge(PayloadTooLarge):
    """A store value is larger than 1 MiB."""

    code = "value_too_large"


class QuotaExceeded(ClientError):
    code = "quota_exceeded"
    http_status = 429


class BackendUnavailable(ClientError):
    """The requested backend does not exist or cannot run on any edge."""

    code = "backend_unavailable"
    http_status = 422


class ServerError(DsecError):
    """The platform or one of its peers failed; the request itself may be fine."""

    code = "server_error"
    http_status = 500


class Internal(ServerError):
    code = "internal"
    http_status = 500


class SandboxFailed(ServerError):
    """The sandbox could not be created or died underneath the request."""

    code = "sandbox_failed"
    http_status = 500


class Unavailable(ServerError):
    code = "unavailable"
    http_status = 503


class NodeFull(Unavailable):
    """An edge refused admission because it has no room; another edge may have."""

    code = "node_full"


class StoreUnavailable(Unavailable):
    """The state store cannot be reached or has no leader; a write may or may not have applied."""

    code = "store_unavailable"


class DeadlineExceeded(ServerError):
    code = "deadline_exceeded"
    http_status = 504


def _all_subclasses(cls: type[DsecError]) -> list[type[DsecError]]:
    out: list[type[DsecError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[DsecError]] = {c.code: c for c in _all_subclasses(DsecError)}


def error_from_wire(code: str, message: str) -> DsecError:
    """Rebuild the error a peer reported; unknown codes become :class:`Internal`."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        return Internal(f"{code}: {message}")
    return cls(message)
