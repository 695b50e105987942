"""``dsec audit``: query and verify the audit log (needs an admin key)."""

from __future__ import annotations

import datetime as dt

import click

from dsec.cli.output import json_option, print_json, simple_table, state, stdout


@click.group("audit", invoke_without_command=True)
@click.option("--since", default="", help="Epoch seconds, ISO-8601, or an age: 30s 10m 2h 7d.")
@click.option("--until", default="", help="Same forms as --since.")
@click.option("--project", default="", help="Only this project.")
@click.option("--actor", default="", help="Only this actor (exact).")
@click.option("--action", default="", help="Exact action, or a prefix ending in '.'.")
@click.option("--limit", type=click.IntRange(1, 10000), default=1000, show_default=True)
@json_option
@click.pass_context
def audit_group(ctx: click.Context, since: str, until: str, project: str, actor: str,
                action: str, limit: int, as_json: bool) -> None:  # fmt: skip
    """Who did what to which project and when: IAM changes and sandbox lifecycle actions."""
    if ctx.invoked_subcommand is not None:
        return
    entries = state().client().audit(since=since, until=until, project=project, actor=actor,
                                     action=action, limit=limit)  # fmt: skip
    if as_json:
        print_json(entries)
        return
    rows = [
        [str(e.seq), dt.datetime.fromtimestamp(e.ts).isoformat(timespec="seconds"), e.actor,
         e.action, e.project, e.target, e.result]
        for e in entries
    ]  # fmt: skip
    cols = ["SEQ", "TIME", "ACTOR", "ACTION", "PROJECT", "TARGET", "RESULT"]
    stdout().print(simple_table(cols, rows))


@audit_group.command("verify")
@json_option
def verify(as_json: bool) -> None:
    """Check the hash chain of the whole log; exit 1 if any entry was altered or removed."""
    verdict = state().client().verify_audit()
    if as_json:
        print_json(verdict)
    elif verdict.get("intact"):
        click.echo(f"audit log intact: {verdict['entries']} entries, head {verdict['head_hash']}")
    else:
        click.echo(f"audit log BROKEN at entry {verdict.get('broken_at')}", err=True)
    if not verdict.get("intact"):
        raise click.exceptions.Exit(1)
