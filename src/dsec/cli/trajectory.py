"""``dsec trajectory ls|show|export|rm|quota``: the trajectory log of recorded runtime calls.

A trajectory is named by the user (``run42/ep7``) within a project; these commands take that
name (resolved in the key's project, or ``--project``) or the trajectory's id.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import click

from dsec.cli.output import json_option, print_json, simple_table, state, stdout
from dsec.core.errors import NotFound


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _resolve(name: str, project: str | None) -> dict[str, Any]:
    client = state().client()
    found = client.list_trajectories(project, name)
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        projects = ", ".join(sorted(t["project"] for t in found))
        raise NotFound(f"trajectory {name!r} exists in several projects ({projects}): --project")
    if name.isalnum() and len(name) == 32:
        return client.get_trajectory(name)
    raise NotFound(f"no trajectory {name!r}")


project_option = click.option("--project", default=None, help="Project (default: the key's).")


@click.group("trajectory")
def trajectory_group() -> None:
    """Recorded trajectories: every runtime call of a bound sandbox, replayable."""


@trajectory_group.command("ls")
@project_option
@json_option
def ls(project: str | None, as_json: bool) -> None:
    """List trajectories."""
    items = state().client().list_trajectories(project)
    if as_json:
        print_json(items)
        return
    rows = [
        [
            t["name"],
            t["project"],
            str(t["steps"]),
            str(t["bytes"]),
            t["mode"],
            t["sandbox_id"],
            _when(t["updated_at"]),
        ]
        for t in items
    ]
    columns = ["NAME", "PROJECT", "STEPS", "BYTES", "MODE", "SANDBOX", "UPDATED"]
    stdout().print(simple_table(columns, rows))


@trajectory_group.command("show")
@click.argument("name")
@project_option
@json_option
def show(name: str, project: str | None, as_json: bool) -> None:
    """One trajectory: steps, size, replay state, checkpoints, last divergence."""
    t = _resolve(name, project)
    if as_json:
        print_json(t)
        return
    for key in ("name", "id", "project", "sandbox_id", "steps", "bytes", "mode", "cursor"):
        click.echo(f"{key:12} {t[key]}")
    click.echo(
        f"{'policy':12} on_mismatch={t['on_mismatch']} checkpoint_every={t['checkpoint_every']}"
    )
    for k in t["checkpoints"]:
        click.echo(f"{'checkpoint':12} step {k['step']} image {k['image']}")
    if t.get("divergence"):
        d = t["divergence"]
        click.echo(
            f"{'divergence':12} step {d['step']} field {d['field']}: "
            f"recorded {d['recorded']!r}, got {d['actual']!r}"
        )


@trajectory_group.command("export")
@click.argument("name")
@project_option
@click.option("-o", "--output", type=click.File("w"), default="-", help="File (default stdout).")
def export(name: str, project: str | None, output: Any) -> None:
    """Write every step as JSON Lines (request, result, payloads in base64)."""
    t = _resolve(name, project)
    for step in state().client().export_trajectory(t["id"]):
        output.write(json.dumps(step, separators=(",", ":")) + "\n")


@trajectory_group.command("rm")
@click.argument("names", nargs=-1, required=True)
@project_option
def rm(names: tuple[str, ...], project: str | None) -> None:
    """Remove trajectories, their steps and their checkpoint images."""
    for name in names:
        t = _resolve(name, project)
        state().client().remove_trajectory(t["id"])
        click.echo(f"removed {t['name']} ({t['steps']} steps)")


@trajectory_group.command("quota")
@project_option
@click.option("--set", "limit", type=int, default=None, help="New limit in bytes (admin; 0: none).")
@json_option
def quota(project: str | None, limit: int | None, as_json: bool) -> None:
    """Show (or set) the quota on the trajectory log bytes of a project and the projects
    beneath it."""
    client = state().client()
    if limit is not None:
        if not project:
            raise click.UsageError("--set needs --project")
        got = client.set_trajectory_quota(project, limit)
    else:
        got = client.trajectory_quota(project)
    if as_json:
        print_json(got)
    else:
        click.echo(
            f"{got['project']}: {got['used_bytes']} of {got['limit_bytes'] or 'unlimited'} bytes"
        )
