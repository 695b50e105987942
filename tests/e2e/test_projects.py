"""The project tree through the real platform: quotas on subtrees, keys act beneath their
project and nowhere else."""

from __future__ import annotations

import pytest

from dsec.core import errors
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform


def _client(platform: RunningPlatform, api: Client, subject: str, project: str,
            role: str) -> Client:  # fmt: skip
    key = api.create_key(subject, project, role, "tree test")
    return Client(api_url=platform.api_url, api_key=key.api_key)


def test_tree_quotas_and_the_authorization_matrix(platform: RunningPlatform, api: Client) -> None:
    api.put_project("acme", max_sandboxes=2)
    api.put_project("acme/rl", max_sandboxes=5)
    api.put_project("acme/rl/exp1")
    api.put_project("other")
    team = _client(platform, api, "teamlead", "acme/rl", "member")
    viewer = _client(platform, api, "watcher", "acme/rl", "viewer")
    outsider = _client(platform, api, "eve", "other", "member")
    made: list[Sandbox] = []
    try:
        made.append(Sandbox.create(memory_mb=64, cpu=0.1, project="acme/rl/exp1", client=team))
        made.append(Sandbox.create(memory_mb=64, cpu=0.1, client=team))  # its own project
        assert {s.info().project for s in made} == {"acme/rl/exp1", "acme/rl"}
        with pytest.raises(errors.QuotaExceeded, match="'acme'"):
            Sandbox.create(memory_mb=64, cpu=0.1, project="acme/rl/exp1", client=team)
        with pytest.raises(errors.PermissionDenied):
            Sandbox.create(memory_mb=64, project="other", client=team)
        with pytest.raises(errors.PermissionDenied):
            Sandbox.create(memory_mb=64, client=viewer)

        # The team (and its viewer) see and drive what is beneath acme/rl; eve sees nothing.
        assert {s.id for s in team.list_sandboxes()} == {s.id for s in made}
        assert {s.id for s in viewer.list_sandboxes()} == {s.id for s in made}
        assert outsider.list_sandboxes() == []
        for s in made:
            with pytest.raises(errors.SandboxNotFound):
                outsider.get_sandbox(s.id)
            with pytest.raises(errors.SandboxNotFound):
                outsider.kill_sandbox(s.id)
            with pytest.raises(errors.SandboxNotFound):
                outsider.sandbox(s.id).exec("true")
            with pytest.raises(errors.PermissionDenied):
                viewer.sandbox(s.id).exec("true")
            assert team.sandbox(s.id).exec("echo ok").stdout == "ok\n"
        assert team.usage("acme/rl")["sandboxes"] == 2
        with pytest.raises(errors.PermissionDenied):
            outsider.usage("acme")
        with pytest.raises(errors.InvalidState, match="live sandboxes"):
            api.delete_project("acme/rl/exp1")
    finally:
        for s in made:
            api.kill_sandbox(s.id)
    # Freed quota is usable again, and empty projects can go.
    again = Sandbox.create(memory_mb=64, cpu=0.1, project="acme/rl/exp1", client=team)
    api.kill_sandbox(again.id)
    api.delete_project("acme/rl/exp1")
    with pytest.raises(errors.NotFound):
        api.create_key("late", "acme/rl/exp1", "member", "")
    for c in (team, viewer, outsider):
        c.close()
