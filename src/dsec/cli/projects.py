"""``dsec project ...`` and ``dsec quota set``: the project tree and its quotas."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

from dsec.cli.output import json_option, print_json, simple_table, state, stdout

_limits = [
    click.option("--max-sandboxes", type=click.IntRange(min=0), default=0,
                 help="Concurrent sandboxes in the whole subtree (0: no limit)."),
    click.option("--max-cpu", type=click.FloatRange(min=0), default=0.0,
                 help="vCPUs in the whole subtree (0: no limit)."),
    click.option("--max-memory", type=click.IntRange(min=0), default=0,
                 help="Memory in MiB in the whole subtree (0: no limit)."),
]  # fmt: skip


F = TypeVar("F", bound=Callable[..., None])


def _with_limits(fn: F) -> F:
    for opt in reversed(_limits):
        fn = opt(fn)
    return fn


@click.group("project")
def project_group() -> None:
    """Projects nest (org/team/exp); a quota bounds everything beneath it (admin)."""


def _put(name: str, max_sandboxes: int, max_cpu: float, max_memory: int, as_json: bool) -> None:
    saved = state().client().put_project(name, max_sandboxes=max_sandboxes, max_cpu=max_cpu,
                                         max_memory_mb=max_memory)  # fmt: skip
    if as_json:
        print_json(saved)
    else:
        click.echo(
            f"project {saved['name']}: max_sandboxes={saved['max_sandboxes']} "
            f"max_cpu={saved['max_cpu']:g} max_memory_mb={saved['max_memory_mb']}"
        )


@project_group.command("create")
@click.argument("name")
@_with_limits
@json_option
def create(name: str, max_sandboxes: int, max_cpu: float, max_memory: int, as_json: bool) -> None:
    """Create project NAME (e.g. org/team; the parent must exist)."""
    _put(name, max_sandboxes, max_cpu, max_memory, as_json)


@project_group.command("ls")
@json_option
def list_projects(as_json: bool) -> None:
    """The projects you act on."""
    items = state().client().list_projects()
    if as_json:
        print_json(items)
        return
    rows = [[p["name"], str(p["max_sandboxes"] or "-"), f"{p['max_cpu'] or '-'}",
             str(p["max_memory_mb"] or "-")] for p in items]  # fmt: skip
    stdout().print(simple_table(["PROJECT", "MAX SANDBOXES", "MAX CPU", "MAX MEMORY MB"], rows))


@project_group.command("rm")
@click.argument("name")
def remove(name: str) -> None:
    """Delete an empty leaf project (its keys are revoked)."""
    state().client().delete_project(name)
    click.echo(f"deleted project {name}")


@project_group.command("usage")
@click.argument("name", required=False, default="")
@json_option
def usage(name: str, as_json: bool) -> None:
    """What a project and everything beneath it use, against its quota."""
    u = state().client().usage(name)
    if as_json:
        print_json(u)
        return
    click.echo(f"{u['project']}: {u['sandboxes']}/{u['max_sandboxes'] or '∞'} sandboxes, "
               f"{u['cpu']:g}/{u['max_cpu'] or '∞'} vCPU, "
               f"{u['memory_mb']}/{u['max_memory_mb'] or '∞'} MiB")  # fmt: skip


@project_group.command("grant")
@click.argument("project")
@click.argument("user")
@click.argument("role", type=click.Choice(["admin", "member", "viewer", "none"]))
def grant(project: str, user: str, role: str) -> None:
    """Give USER ROLE on PROJECT and everything beneath it ("none" takes it away).

    viewer reads; member also creates and uses sandboxes; admin also manages the quotas,
    keys and members of the subtree. PROJECT "*" is the whole platform.
    """
    state().client().grant_role(project, user, "" if role == "none" else role)
    click.echo(
        f"{user}: {role} on {project}" if role != "none" else f"{user}: no role on {project}"
    )


@project_group.command("members")
@click.argument("project", required=False, default="")
@json_option
def members(project: str, as_json: bool) -> None:
    """The role grants on PROJECT (all you can see when omitted)."""
    items = state().client().list_grants(project)
    if as_json:
        print_json(items)
        return
    rows = [[g["project"], g["subject"], g["role"]] for g in items]
    stdout().print(simple_table(["PROJECT", "SUBJECT", "ROLE"], rows))


@click.group("quota")
def quota_group() -> None:
    """Quotas of projects (admin)."""


@quota_group.command("set")
@click.argument("name")
@_with_limits
@json_option
def set_quota(name: str, max_sandboxes: int, max_cpu: float, max_memory: int,
              as_json: bool) -> None:  # fmt: skip
    """Set the quota of project NAME (it may be below current usage: new creates then fail)."""
    _put(name, max_sandboxes, max_cpu, max_memory, as_json)
