"""Project-scoped roles through the real platform: grants are inherited downward, and every
route refuses (403) a caller without the role it needs on the project concerned."""

from __future__ import annotations

import secrets
import time

import pytest

from dsec.core import errors
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform


def _as(platform: RunningPlatform, api: Client, subject: str, project: str, role: str) -> Client:
    key = api.create_key(subject, project, role, "roles test")
    return Client(api_url=platform.api_url, api_key=key.api_key)


def test_grants_are_inherited_downward_and_checked_on_every_route(
    platform: RunningPlatform, api: Client
) -> None:
    org = f"roles{secrets.token_hex(3)}"
    api.put_project(org)
    api.put_project(f"{org}/a", max_sandboxes=4)
    api.put_project(f"{org}/a/exp")
    api.put_project(f"{org}/b")
    api.put_project(f"{org}-other")
    # Keys of a low project with the weakest role: their reach comes from grants.
    lead = _as(platform, api, f"{org}-lead", f"{org}/a/exp", "viewer")
    dev = _as(platform, api, f"{org}-dev", f"{org}/a/exp", "viewer")
    auditor = _as(platform, api, f"{org}-aud", f"{org}/a/exp", "viewer")
    api.grant_role(f"{org}/a", f"{org}-lead", "admin")
    api.grant_role(f"{org}/a", f"{org}-dev", "member")
    api.grant_role(org, f"{org}-aud", "viewer")
    made: list[Sandbox] = []
    try:
        # member on org/a: creates beneath it (inherited), not in org/b nor in org itself.
        made.append(Sandbox.create(memory_mb=64, cpu=0.1, project=f"{org}/a/exp", client=dev))
        for where in (f"{org}/b", org, f"{org}-other"):
            with pytest.raises(errors.PermissionDenied) as denied:
                Sandbox.create(memory_mb=64, project=where, client=dev)
            assert denied.value.http_status == 403  # the HTTP status the apiserver answered
        assert dev.sandbox(made[0].id).exec("echo hi").stdout == "hi\n"
        # viewer on org (inherited by org/a/exp): reads, and is refused with 403 on writes.
        assert auditor.get_sandbox(made[0].id).project == f"{org}/a/exp"
        assert {s.id for s in auditor.list_sandboxes()} == {made[0].id}
        with pytest.raises(errors.PermissionDenied):
            auditor.kill_sandbox(made[0].id)
        with pytest.raises(errors.PermissionDenied):
            auditor.sandbox(made[0].id).exec("true")
        with pytest.raises(errors.PermissionDenied):
            Sandbox.create(memory_mb=64, project=f"{org}/b", client=auditor)
        assert auditor.usage(f"{org}/a")["sandboxes"] == 1
        with pytest.raises(errors.PermissionDenied):
            auditor.usage(f"{org}-other")
        # admin on org/a: manages quotas, members and keys of its subtree only.
        lead.put_project(f"{org}/a/exp", max_sandboxes=3)
        lead.put_project(f"{org}/a/new")
        lead.grant_role(f"{org}/a/new", f"{org}-dev", "viewer")
        for forbidden in (
            lambda: lead.put_project(f"{org}/a", max_sandboxes=100),  # its own limit: parent's
            lambda: lead.put_project(f"{org}/b", max_sandboxes=1),
            lambda: lead.grant_role(f"{org}/b", f"{org}-dev", "member"),
            lambda: lead.grant_role("*", f"{org}-dev", "admin"),
            lambda: lead.create_key("admin", f"{org}/a", "member", ""),  # reaches beyond org/a
            lambda: dev.grant_role(f"{org}/a/exp", f"{org}-dev", "admin"),
            lambda: dev.put_project(f"{org}/a/exp2"),
            lambda: lead.list_edges(),
        ):
            with pytest.raises(errors.PermissionDenied):
                forbidden()
        minted = lead.create_key(f"{org}-dev", f"{org}/a/exp", "member", "by the lead")
        assert minted.key_id in {k.key_id for k in lead.list_keys()}
        assert {k.project for k in lead.list_keys()} <= {f"{org}/a", f"{org}/a/exp"}
        assert {g["subject"] for g in lead.list_grants(f"{org}/a/new")} == {f"{org}-dev"}
        lead.delete_project(f"{org}/a/new")
        # Taking a grant away takes effect (each apiserver caches grants for ~2 s).
        api.grant_role(f"{org}/a", f"{org}-dev", "")
        for _ in range(50):
            try:
                Sandbox.create(memory_mb=64, project=f"{org}/a/exp", client=dev).kill()
            except errors.PermissionDenied:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the removed grant still lets dev create sandboxes")
    finally:
        for s in made:
            api.kill_sandbox(s.id)
        for c in (lead, dev, auditor):
            c.close()
