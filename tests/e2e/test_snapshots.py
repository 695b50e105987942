"""Named snapshots through the SDK and the whole platform: container (filesystem) and
microvm (full: memory, processes, disk), project ownership, bad input, and fork children
admitted by the project quota like creates."""

from __future__ import annotations

import uuid

import pytest

from dsec.core import errors
from dsec.sdk import Client, Sandbox, SandboxInfo, wire
from dsec.testing.platform import RunningPlatform
from tests.e2e.test_microvm import _qemu_count, _skip_reason

UNKNOWN = "snp-zzzz-aaaaaaaaaaaaaaaaaaaa"


def _key(platform: RunningPlatform, api: Client, project: str, role: str) -> Client:
    key = api.create_key(f"snap-{role}-{uuid.uuid4().hex[:6]}", project, role, "snapshot test")
    return Client(api_url=platform.api_url, api_key=key.api_key)


def test_container_filesystem_snapshot_ls_create_from_rm(
    platform: RunningPlatform, api: Client
) -> None:
    project = f"snap{uuid.uuid4().hex[:6]}"
    api.put_project(project)
    member = _key(platform, api, project, "member")
    api.put_project(project + "x")
    outsider = _key(platform, api, project + "x", "member")
    viewer = _key(platform, api, project, "viewer")
    src = Sandbox.create(memory_mb=256, timeout=120, client=member)
    made: list[Sandbox] = []
    try:
        src.files.write("/root/state.txt", b"before the snapshot")
        with pytest.raises(errors.InvalidArgument, match="container backend"):
            src.snapshot(mode="full")
        snap = src.snapshot("warm")
        assert (snap.mode, snap.backend, snap.project, snap.source_sandbox) == (
            "filesystem", "container", project, src.id,
        )  # fmt: skip
        assert snap.size_bytes > 0
        assert snap.id.startswith("snp-")
        src.files.write("/root/state.txt", b"after")  # the source keeps running
        listed = member.list_snapshots()
        assert [s.id for s in listed] == [snap.id]
        assert [s.id for s in viewer.list_snapshots(name="warm")] == [snap.id]
        assert outsider.list_snapshots(project=project) == []
        with pytest.raises(errors.NotFound):
            outsider.get_snapshot(snap.id)
        with pytest.raises(errors.PermissionDenied):
            viewer.delete_snapshot(snap.id)

        made.append(Sandbox.from_snapshot(snap.id, timeout=60, client=member))
        child = made[-1]
        assert child.files.read("/root/state.txt") == b"before the snapshot"
        assert child.info().project == project
        with pytest.raises(errors.NotFound):
            Sandbox.from_snapshot(snap.id, client=outsider)
        with pytest.raises(errors.InvalidArgument, match="only full ones start on another"):
            Sandbox.from_snapshot(snap.id, edge="elsewhere", client=member)

        assert member.delete_snapshot(snap.id).id == snap.id
        assert member.list_snapshots() == []
        assert child.exec("echo still").stdout == "still\n"  # made from it, still running
        with pytest.raises(errors.SnapshotNotFound):
            Sandbox.from_snapshot(snap.id, client=member)
        with pytest.raises(errors.SnapshotNotFound):
            member.delete_snapshot(snap.id)
        with pytest.raises(errors.SnapshotNotFound):
            Sandbox.from_snapshot(UNKNOWN, client=member)
        with pytest.raises(errors.SnapshotNotFound):
            member.get_snapshot("not-a-snapshot")
        raw = wire.json_request("POST", "/v1/sandboxes", {"snapshot": UNKNOWN, "image": "base"})
        with pytest.raises(errors.InvalidArgument, match="snapshot decides"):
            member.transport.call(wire.Call(raw, SandboxInfo.from_wire))
        images = {i["name"] for i in api.list_images()}
        assert f"dsec-snapshots/{snap.id}" not in images
        assert len(member.list_sandboxes()) == 2  # nothing left by the failures
    finally:
        for s in (src, *made):
            s.kill()
        for c in (member, outsider, viewer):
            c.close()


def test_fork_children_count_against_the_quota(platform: RunningPlatform, api: Client) -> None:
    project = f"fq{uuid.uuid4().hex[:6]}"
    api.put_project(project, max_sandboxes=1)
    member = _key(platform, api, project, "member")
    src = Sandbox.create(memory_mb=256, timeout=120, client=member)
    try:
        with pytest.raises(errors.QuotaExceeded):
            src.fork(count=1)
        assert api.usage(project)["sandboxes"] == 1  # the refused child holds nothing
        api.put_project(project, max_sandboxes=3)
        with pytest.raises(errors.InvalidArgument, match="cannot fork"):
            src.fork(count=2)  # admitted, then refused by the container backend
        assert api.usage(project)["sandboxes"] == 1  # and released again
    finally:
        src.kill()
        member.close()


@pytest.mark.guest_kernel
@pytest.mark.timeout(300)  # TCG boots under a loaded CI machine
def test_microvm_full_snapshot_resumes_processes(platform: RunningPlatform, api: Client) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    src = Sandbox.create(backend="microvm", memory_mb=256, timeout=300, client=api)
    made: list[Sandbox] = []
    try:
        src.files.write("/root/hello.txt", b"from the source")
        sh = src.shell("work")
        sh.run("export X=42")
        snap = src.snapshot("vm-warm")
        assert (snap.mode, snap.backend) == ("full", "microvm")
        assert snap.size_bytes > 0
        assert sh.run("echo $X").stdout.strip() == "42"  # the source goes on
        src.files.write("/root/hello.txt", b"changed after")
        with pytest.raises(errors.InvalidArgument, match="microvm backend"):
            src.snapshot(mode="filesystem")

        made.append(Sandbox.from_snapshot(snap.id, timeout=120, client=api))
        child = made[-1]
        assert child.id != src.id
        assert child.files.read("/root/hello.txt") == b"from the source"
        assert child.shell("work").run("echo $X").stdout.strip() == "42"
        assert child.exec("hostname").stdout.strip() == child.id
        made += src.fork(count=1)  # a fork of a sandbox running from a snapshot
        assert made[-1].files.read("/root/hello.txt") == b"changed after"
        assert child.files.read("/root/hello.txt") == b"from the source"
        api.delete_snapshot(snap.id)
        assert child.exec("echo alive").stdout == "alive\n"  # its RAM outlives the snapshot
        with pytest.raises(errors.SnapshotNotFound):
            Sandbox.from_snapshot(snap.id, client=api)
    finally:
        for s in (*made, src):
            s.kill()
    assert _qemu_count(platform.paths.home) == 0
    templates = platform.paths.home / "edge" / "vm-templates"
    assert not templates.exists() or not any(templates.iterdir())
