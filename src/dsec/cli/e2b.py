"""``dsec e2b env``: the shell lines that point unmodified E2B code at this platform."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from dsec.cli.output import state
from dsec.paths import Paths
from dsec.sdk.config import resolve_config
from dsec.supervisor import Layout, layout_path


def local_gateway_url(home: Path | None) -> str | None:
    """The E2B gateway of the platform ``dsec up`` runs from ``home`` (None if unknown)."""
    try:
        lay = Layout.load(layout_path(Paths.from_env(home)))
    except (OSError, ValueError, TypeError):
        return None
    return f"http://{lay.gateway}" if lay.gateway else None


@click.group("e2b")
def e2b_group() -> None:
    """Use OpenDsec from code written for the E2B SDK."""


@e2b_group.command("env")
@click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    envvar="DSEC_HOME",
    help="State directory of the local platform (default /var/lib/dsec).",
)
@click.option(
    "--gateway-url",
    default=None,
    envvar="DSEC_E2B_URL",
    help="The gateway's URL [env DSEC_E2B_URL]; default: the local platform's.",
)
@click.option(
    "--domain",
    default=None,
    help="The gateway's --domain (it serves HTTPS): print E2B_DOMAIN and SSL_CERT_FILE instead.",
)
def env(home: Path | None, gateway_url: str | None, domain: str | None) -> None:
    """Print `export` lines for E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY.

    Use them with: eval "$(dsec e2b env)". The key is the one this CLI uses (--api-key,
    DSEC_API_KEY or the local client file), so sandboxes land in that key's project.
    With --domain: E2B_DOMAIN, E2B_API_KEY and SSL_CERT_FILE (the cluster CA).
    """
    if domain:
        st = state()
        key = resolve_config(st.api_url, st.api_key, environ=st.environ).api_key
        ca = Paths.from_env(home).pki / "ca.crt"
        lines = (("E2B_DOMAIN", domain), ("E2B_API_KEY", key), ("SSL_CERT_FILE", str(ca)))
        for name, value in lines:
            click.echo(f"export {name}={shlex.quote(value)}")
        return
    url = gateway_url or local_gateway_url(home)
    if not url:
        raise click.ClickException(
            "no E2B gateway found: start the platform with `dsec up` or pass --gateway-url"
        )
    st = state()
    key = resolve_config(st.api_url, st.api_key, environ=st.environ).api_key
    url = url.rstrip("/")
    for name, value in (("E2B_API_URL", url), ("E2B_SANDBOX_URL", url), ("E2B_API_KEY", key)):
        click.echo(f"export {name}={shlex.quote(value)}")
