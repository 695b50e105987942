"""The SDK's trajectory calls (sans-I/O): create fields, the idempotent mark, routes."""

from __future__ import annotations

import json

import pytest

from dsec.core import errors
from dsec.sdk import runtime_calls as rc
from dsec.sdk import trajectory_calls as tc
from dsec.sdk import wire

SID = "sbx-e0a1-abcdefghijklmnopqrst"


def test_create_carries_the_trajectory_policy() -> None:
    extra = tc.policy_body("run42/ep7", "fail", 10)
    call = wire.create_sandbox(
        backend=None, image=None, cpu=None, memory_mb=None, pids=None, timeout_s=None,
        env=None, metadata=None, extra=extra,
    )  # fmt: skip
    assert call.request.body is not None
    body = json.loads(call.request.body)
    assert body == {"trajectory": "run42/ep7", "on_mismatch": "fail", "checkpoint_every": 10}
    assert tc.policy_body(None, "diverge", 0) == {}
    assert tc.policy_body("t", "diverge", 0) == {"trajectory": "t", "on_mismatch": "diverge"}


@pytest.mark.parametrize(
    ("trajectory", "on_mismatch", "every"),
    [("", "diverge", 0), ("t", "ignore", 0), ("t", "fail", -1), ("t", "fail", True)],
)
def test_bad_policies_are_refused_before_sending(
    trajectory: str, on_mismatch: str, every: int
) -> None:
    with pytest.raises(errors.InvalidArgument):
        tc.policy_body(trajectory, on_mismatch, every)


def test_idempotent_marks_the_request_only_when_asked() -> None:
    call = rc.exec_command(SID, "pip install x")
    assert tc.idempotent(call, False) is call
    marked = tc.idempotent(call, True).request
    assert ("X-Dsec-Idempotent", "1") in marked.headers
    assert ("Content-Type", "application/json") in marked.headers
    assert marked.body == call.request.body


def test_routes() -> None:
    assert tc.status(SID).request.path == f"/v1/sandboxes/{SID}/trajectory"
    assert tc.checkpoint(SID).request.method == "POST"
    assert tc.list_trajectories("team", "run/1").request.params == (
        ("project", "team"),
        ("name", "run/1"),
    )
    tid = "a" * 32
    assert tc.export(tid).request.params == (("format", "json"),)
    assert tc.remove(tid).request.method == "DELETE"
    with pytest.raises(errors.InvalidArgument):
        tc.get("../keys")
