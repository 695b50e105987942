"""``dsec ca rotate|status``: rotate the cluster CA of the internal mTLS mesh without downtime.

These commands speak to the iam directly over mTLS as the ``admin`` identity, using the
certificates in ``--pki`` (on the iam's machine: its ``<home>/pki``, which the iam keeps
current through a rotation). See docs/ca-rotation.md.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import click
from google.protobuf.json_format import MessageToDict

from dsec.cli.output import json_option, print_json
from dsec.core.errors import DeadlineExceeded
from dsec.paths import Paths
from dsec.rpc._gen import ca_pb2 as pb
from dsec.rpc._gen import ca_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.tls import Identity

DEFAULT_IAM = "127.0.0.1:8421"


def _target(iam: str | None, pki: Path | None) -> tuple[str, Path]:
    return iam or os.environ.get("DSEC_IAM", DEFAULT_IAM), pki or Paths.from_env().pki


async def _call(iam: str, pki: Path, method: str, request: Any) -> pb.CaStatus:
    async with secure_channel(pki, "admin", iam, server=Identity.singleton("iam")) as ch:
        reply: pb.CaStatus = await getattr(pb_grpc.CaStub(ch), method)(request, timeout=30)
        return reply


def _counts(st: pb.CaStatus) -> tuple[int, int, int]:
    live = [c for c in st.components if c.live]
    return len(live), sum(c.trusts_signing for c in live), sum(c.on_signing for c in live)


def _progress(st: pb.CaStatus) -> str:
    n, trusting, on = _counts(st)
    if st.phase == "distributing":
        return f"distributing the new CA: {trusting}/{n} components trust it"
    if st.phase == "reissuing":
        waiting = [_who(c) for c in st.components if c.live and not c.on_signing]
        return f"re-issuing: {on}/{n} components on the new CA (waiting: {', '.join(waiting)})"
    if st.phase == "ready":
        return f"ready: {on}/{n} components on the new CA"
    return f"{st.phase}: {on}/{n} components on CA {st.signing[:16]}"


def _who(c: pb.CaComponent) -> str:
    return f"{c.identity.removeprefix('spiffe://dsec/')} ({c.instance})"


def _print_status(st: pb.CaStatus) -> None:
    click.echo(f"phase    {st.phase}")
    click.echo(f"signing  {st.signing}")
    for old in st.old:
        click.echo(f"old      {old}  (still trusted)")
    click.echo(f"{'COMPONENT':34} {'INSTANCE':24} {'CA':10} {'TRUSTS NEW':10} SEEN")
    now = time.time()
    for c in st.components:
        ca = "new" if c.on_signing else ("old" if st.old else "-")
        seen = f"{now - c.last_seen:.0f}s ago" + ("" if c.live else " (gone)")
        trusts = "yes" if c.trusts_signing else "no"
        ident = c.identity.removeprefix("spiffe://dsec/")
        click.echo(f"{ident:34} {c.instance:24} {ca:10} {trusts:10} {seen}")
    for line in st.message:
        click.echo(line)


_iam_opt = click.option(
    "--iam", default=None, help=f"the iam's HOST:PORT [env DSEC_IAM; {DEFAULT_IAM}]"
)
_pki_opt = click.option(
    "--pki",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="directory with ca.crt, admin.crt and admin.key [$DSEC_HOME/pki]",
)


@click.group("ca")
def ca_group() -> None:
    """The cluster CA of the internal mTLS mesh (platform admin)."""


@ca_group.command("status")
@_iam_opt
@_pki_opt
@json_option
def ca_status(iam: str | None, pki: Path | None, as_json: bool) -> None:
    """Which CA signs, which are trusted, and which components still use the old one."""
    st = asyncio.run(_call(*_target(iam, pki), "Status", pb.CaStatusRequest()))
    if as_json:
        print_json(MessageToDict(st, preserving_proto_field_name=True))
    else:
        _print_status(st)


@ca_group.command("rotate")
@_iam_opt
@_pki_opt
@click.option("--finish", is_flag=True, help="Second step: drop the old CA from the bundle.")
@click.option("--force", is_flag=True, help="With --finish: even if components still use it.")
@click.option("--wait/--no-wait", default=True, help="Wait until every component moved.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait.")
def ca_rotate(
    iam: str | None, pki: Path | None, finish: bool, force: bool, wait: bool, timeout: float
) -> None:
    """Start a CA rotation (a new CA, trusted next to the old one), or --finish it.

    Without --finish: makes the new CA, then shows progress until every live component
    presents a certificate of it. Then run `dsec ca rotate --finish`, which refuses (naming
    them) while components still use the old CA; after it, old-CA certificates are refused.
    """
    target = _target(iam, pki)
    if finish:
        st = asyncio.run(_call(*target, "Finish", pb.CaFinishRequest(force=force)))
        click.echo(f"finished: only CA {st.signing[:16]} is trusted now")
        for line in st.message:
            click.echo(line, err=True)
        return
    st = asyncio.run(_call(*target, "Rotate", pb.CaRotateRequest()))
    click.echo(
        f"new CA {st.signing[:16]}; old CA {', '.join(o[:16] for o in st.old)} still trusted"
    )
    if not wait:
        click.echo("follow with `dsec ca status`, then `dsec ca rotate --finish`", err=True)
        return
    st = asyncio.run(_wait_ready(*target, timeout))
    click.echo("every component uses the new CA: run `dsec ca rotate --finish` to drop the old one")


async def _wait_ready(iam: str, pki: Path, wait_s: float) -> pb.CaStatus:
    deadline = time.monotonic() + wait_s
    last = ""
    while True:
        st = await _call(iam, pki, "Status", pb.CaStatusRequest())
        line = _progress(st)
        if line != last:
            click.echo(line, err=True)
            last = line
        if st.phase in ("ready", "idle"):
            return st
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"not every component moved within {wait_s:g} s: {line}")
        await asyncio.sleep(1.0)
