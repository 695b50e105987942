"""``dsec token ...`` and ``dsec user revoke``: access tokens and revocation."""

from __future__ import annotations

import click

from dsec.cli.output import json_option, print_json, state, stderr


@click.group("token")
def token_group() -> None:
    """Short-lived access tokens (exchanged for your API key)."""


@token_group.command("create")
@click.option("--ttl", type=click.IntRange(1, 3600), default=600, show_default=True,
              help="Lifetime in seconds.")  # fmt: skip
@json_option
def create(ttl: int, as_json: bool) -> None:
    """Print a new access token (use it as DSEC_API_KEY)."""
    tok = state().client().create_token(ttl)
    if as_json:
        print_json(tok)
    else:
        click.echo(tok.token)
        stderr().print(f"token id {tok.token_id}, valid for {ttl} s")


@token_group.command("revoke")
@click.argument("token_id")
def revoke_token(token_id: str) -> None:
    """Revoke one token everywhere (within a few seconds on every apiserver)."""
    state().client().revoke("token", token_id)
    click.echo(f"revoked token {token_id}")


@click.group("user")
def user_group() -> None:
    """Act on everything of one subject (admin)."""


@user_group.command("revoke")
@click.argument("subject")
def revoke_user(subject: str) -> None:
    """Revoke every API key and access token of SUBJECT."""
    state().client().revoke("subject", subject)
    click.echo(f"revoked every key and token of {subject}")
