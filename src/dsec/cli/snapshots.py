"""``dsec snapshot ...``: take named snapshots of running sandboxes, list and remove them.
Start a sandbox from one with ``dsec sandbox create --from-snapshot ID``."""

from __future__ import annotations

from datetime import UTC, datetime

import click
from rich.table import Table

from dsec.cli.output import json_option, print_json, report, simple_table, state, stderr, stdout
from dsec.core.errors import DsecError
from dsec.sdk import SnapshotInfo


@click.group("snapshot")
def snapshot_group() -> None:
    """Named snapshots of running sandboxes."""


@snapshot_group.command("create")
@click.argument("sandbox_id")
@click.option("--name", default="", help="A name to find it by (dsec snapshot ls --name).")
@click.option(
    "--mode",
    type=click.Choice(["full", "filesystem"]),
    default=None,
    help="full: memory, processes and disk (microvm); filesystem: files only (container). "
    "Default: what the sandbox's backend can.",
)
@json_option
def create(sandbox_id: str, name: str, mode: str | None, as_json: bool) -> None:
    """Snapshot a running sandbox (it keeps running) and print the snapshot id."""
    client = state().client()
    with stderr().status(f"snapshotting {sandbox_id}"):
        snap = client.sandbox(sandbox_id).snapshot(name, mode)
    if as_json:
        print_json(snap)
    else:
        click.echo(snap.id)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"


def _when(t: datetime | None) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def snapshot_table(snaps: list[SnapshotInfo]) -> Table:
    rows = [
        [s.id, s.name or "-", s.project, s.source_sandbox, s.backend, s.mode,
         _size(s.size_bytes), s.edge_id, _when(s.created_at)]
        for s in snaps
    ]  # fmt: skip
    cols = ["ID", "NAME", "PROJECT", "SOURCE", "BACKEND", "MODE", "SIZE", "EDGE", "CREATED"]
    return simple_table(cols, rows)


@snapshot_group.command("ls")
@click.option("--project", default="", help="Only this project (and its subprojects).")
@click.option("--sandbox", "sandbox_id", default="", help="Only snapshots of this sandbox.")
@click.option("--name", default="", help="Only snapshots with this name.")
@json_option
def list_snapshots(project: str, sandbox_id: str, name: str, as_json: bool) -> None:
    """List the snapshots you can see, oldest first."""
    snaps = state().client().list_snapshots(project, sandbox_id, name)
    if as_json:
        print_json(snaps)
    elif not snaps:
        stderr().print("no snapshots")
    else:
        stdout().print(snapshot_table(snaps))


@snapshot_group.command("rm")
@click.argument("snapshot_ids", nargs=-1, required=True)
def remove(snapshot_ids: tuple[str, ...]) -> None:
    """Remove snapshots (sandboxes made from them keep running)."""
    client = state().client()
    worst = 0
    for sid in snapshot_ids:
        try:
            client.delete_snapshot(sid)
        except DsecError as exc:
            worst = max(worst, report(exc))
            continue
        click.echo(f"removed {sid}")
    if worst:
        raise click.exceptions.Exit(worst)
