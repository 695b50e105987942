"""Batch lifecycle through the real platform: pause/resume/kill many container sandboxes in
one call, by ids or by project, each authorized and audited on its own; ids that do not
exist or belong to someone else fail alone."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from dsec.core import errors
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform

UNKNOWN = "sbx-e0a1-zzzzzzzzzzzzzzzzzzzz"  # well-formed, on no edge


def _client(platform: RunningPlatform, api: Client, subject: str, project: str) -> Client:
    key = api.create_key(subject, project, "member", "batch test")
    return Client(api_url=platform.api_url, api_key=key.api_key)


def test_mixed_batches_by_ids_and_project(platform: RunningPlatform, api: Client) -> None:
    api.put_project("batch")
    api.put_project("batch/team")
    api.put_project("batchother")
    alice = _client(platform, api, "alice", "batch/team")
    eve = _client(platform, api, "eve", "batchother")
    mine = [Sandbox.create(memory_mb=64, cpu=0.1, timeout=300, client=alice) for _ in range(2)]
    theirs = Sandbox.create(memory_mb=64, cpu=0.1, timeout=300, client=eve)
    ids = [s.id for s in mine]
    try:
        results = alice.batch_sandboxes("pause", ids=[*ids, theirs.id, UNKNOWN, "garbage"])
        assert [r.id for r in results] == [*ids, theirs.id, UNKNOWN, "garbage"]
        assert [r.ok for r in results] == [True, True, False, False, False]
        assert all(r.sandbox is not None and r.sandbox.state == "paused" for r in results[:2])
        for r in results[2:]:
            assert isinstance(r.error, errors.SandboxNotFound), r
        assert {alice.get_sandbox(i).state for i in ids} == {"paused"}
        assert eve.get_sandbox(theirs.id).state == "running"  # untouched

        # By project: every live sandbox of batch/team (and nothing of eve's).
        resumed = alice.batch_sandboxes("resume", project="batch/team")
        assert sorted(r.id for r in resumed) == sorted(ids)
        assert all(r.ok for r in resumed)
        assert mine[0].exec("echo back").stdout == "back\n"
        with pytest.raises(errors.PermissionDenied, match="needs the member role on project"):
            alice.batch_sandboxes("kill", project="batchother")
        for bad, why in (
            ({"action": "explode", "ids": ids}, "'action' must be one of"),
            ({"action": "kill", "ids": ids, "project": "batch"}, "exactly one of"),
            ({"action": "kill"}, "exactly one of"),
            ({"action": "kill", "ids": "not-a-list"}, "list of sandbox ids"),
            ({"action": "kill", "ids": [], "force": True}, "unknown batch field"),
        ):
            resp = httpx.post(
                f"{platform.api_url}/v1/sandboxes:batch", json=bad, timeout=30,
                headers={"Authorization": f"Bearer {alice.config.api_key}"},
            )  # fmt: skip
            assert resp.status_code == 400, bad
            assert why in resp.json()["error"]["message"]
        assert {alice.get_sandbox(i).state for i in ids} == {"running"}  # nothing was done

        # The CLI: one call for all ids, exit code of the worst failure, failures reported.
        env = {**platform.env(), "DSEC_API_KEY": alice.config.api_key}
        out = subprocess.run(
            [sys.executable, "-m", "dsec.cli.main", "sandbox", "kill", *ids, theirs.id, "--json"],
            env=env, text=True, capture_output=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert [(r["id"], r["state"]) for r in json.loads(out.stdout)] == [
            (ids[0], "stopped"), (ids[1], "stopped"),
        ]  # fmt: skip
        assert "[sandbox_not_found]" in out.stderr
        assert {api.get_sandbox(i).state for i in ids} == {"stopped"}
        assert eve.get_sandbox(theirs.id).state == "running"

        # Each sandbox of a batch has its own audit entry, with its own result.
        entries = [e for e in api.audit(since="10m") if e.actor.startswith("alice")]
        got = [(e.action, e.target, e.result) for e in entries]
        assert ("sandbox.pause", ids[0], "ok") in got
        assert ("sandbox.pause", theirs.id, "sandbox_not_found") in got
        assert ("sandbox.pause", "garbage", "sandbox_not_found") in got
        assert ("sandbox.resume", ids[1], "ok") in got
        assert ("sandbox.kill", ids[1], "ok") in got
        assert next(e.project for e in entries if e.target == ids[0]) == "batch/team"
    finally:
        cleanup = api.batch_sandboxes("kill", ids=[*ids, theirs.id])
        assert all(r.ok for r in cleanup)
        for c in (alice, eve):
            c.close()
    assert api.batch_sandboxes("kill", project="batchother") == []
