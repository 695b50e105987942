"""``dsec keys ...`` (admin keys only) and ``dsec whoami``."""

from __future__ import annotations

import click

from dsec.cli.output import json_option, print_json, simple_table, state, stderr, stdout


@click.group("keys")
def keys_group() -> None:
    """Manage API keys (needs an admin key)."""


@keys_group.command("create")
@click.option("--subject", required=True, help="Who the key is for, e.g. alice.")
@click.option("--project", required=True, help="The project the key acts in.")
@click.option(
    "--role",
    type=click.Choice(["viewer", "member", "admin"]),
    default="member",
    show_default=True,
)
@click.option("--name", default="", help="A label for the key.")
@json_option
def create(subject: str, project: str, role: str, name: str, as_json: bool) -> None:
    """Create a key and print it (it is shown only this once)."""
    new = state().client().create_key(subject, project, role, name)
    if as_json:
        print_json(new)
    else:
        click.echo(new.api_key)
        stderr().print(f"key id {new.key_id}; store the key now, it is not shown again")


@keys_group.command("ls")
@json_option
def list_keys(as_json: bool) -> None:
    """List keys (never their secrets)."""
    keys = state().client().list_keys()
    if as_json:
        print_json(keys)
        return
    rows = [
        [k.key_id, k.subject, k.project, k.role, k.name, "yes" if k.extra.get("revoked") else ""]
        for k in keys
    ]
    columns = ["KEY ID", "SUBJECT", "PROJECT", "ROLE", "NAME", "REVOKED"]
    stdout().print(simple_table(columns, rows))


@keys_group.command("revoke")
@click.argument("key_id")
@json_option
def revoke(key_id: str, as_json: bool) -> None:
    """Revoke a key; requests with it fail from now on."""
    state().client().revoke_key(key_id)
    if as_json:
        print_json({"revoked": key_id})
    else:
        click.echo(f"revoked {key_id}")


@click.command("whoami")
@json_option
def whoami(as_json: bool) -> None:
    """Show who the configured API key belongs to."""
    me = state().client().whoami()
    if as_json:
        print_json(me)
    else:
        click.echo(f"{me.subject} in project {me.project} as {me.role} (key {me.key_id})")
