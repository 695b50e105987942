"""What every ``dsec`` command shares: the lazily built SDK client, JSON and table output, and
the one-line error report with its exit code (2: the caller's fault, 1: the platform's)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsec.core.errors import ClientError, DsecError
from dsec.sdk import Client
from dsec.sdk.config import resolve_config
from dsec.sdk.models import SandboxInfo, to_jsonable

F = TypeVar("F", bound=Callable[..., Any])

EXIT_SERVER_ERROR = 1
EXIT_CLIENT_ERROR = 2
EXIT_TIMEOUT = 124  # like timeout(1)
EXIT_INTERRUPTED = 130  # 128 + SIGINT
PIPE_WIDTH = 250


@dataclass
class CliState:
    """Per-invocation settings; tests pass one as ``obj`` with a fake ``http_transport``."""

    api_url: str | None = None
    api_key: str | None = None
    environ: Mapping[str, str] | None = None
    http_transport: httpx.BaseTransport | None = None
    _client: Client | None = field(default=None, repr=False)

    def client(self) -> Client:
        """The SDK client, configured by the SDK's own resolver (flags > env > client file)."""
        if self._client is None:
            cfg = resolve_config(self.api_url, self.api_key, environ=self.environ)
            self._client = Client(config=cfg, http_transport=self.http_transport)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def state() -> CliState:
    """The current invocation's :class:`CliState`."""
    return click.get_current_context().ensure_object(CliState)


def json_option(fn: F) -> F:
    """Add ``--json`` (machine-readable output) to a command."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


def print_json(obj: Any) -> None:
    click.echo(json.dumps(to_jsonable(obj), indent=2))


def stdout() -> Console:
    """Rich output on stdout; when piped, wide enough that tables are never cut."""
    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=False, width=PIPE_WIDTH)
    return console


def stderr() -> Console:
    return Console(stderr=True, highlight=False)


def exit_code_for(exc: DsecError) -> int:
    return EXIT_CLIENT_ERROR if isinstance(exc, ClientError) else EXIT_SERVER_ERROR


def report(exc: DsecError) -> int:
    """Print ``exc`` as one line on stderr and return the exit code it calls for."""
    click.echo(f"dsec: error: {exc.message} [{exc.code}]", err=True)
    return exit_code_for(exc)


def parse_pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    """Turn repeated ``K=V`` options into a dict."""
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=what)
        out[key] = value
    return out


def _relative(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "-"
    secs = int((when - now).total_seconds())
    span = abs(secs)
    text = (
        f"{span}s"
        if span < 120
        else f"{span // 60}m"
        if span < 7200
        else f"{span // 3600}h"
        if span < 172800
        else f"{span // 86400}d"
    )
    return f"in {text}" if secs >= 0 else f"{text} ago"


_STATE_STYLE = {"running": "green", "creating": "yellow", "failed": "red", "stopped": "dim"}


def sandbox_table(infos: list[SandboxInfo], now: datetime | None = None) -> Table:
    now = now or datetime.now(UTC)
    table = Table(box=None, header_style="bold")
    for col in ("ID", "STATE", "BACKEND", "IMAGE", "CPU", "MEMORY", "CREATED", "EXPIRES"):
        table.add_column(col, no_wrap=True)
    for s in infos:
        spec = s.spec
        style = _STATE_STYLE.get(s.state, "")
        table.add_row(
            escape(s.id),
            f"[{style}]{escape(s.state)}[/{style}]" if style else escape(s.state),
            escape(spec.backend) if spec else "-",
            escape(spec.image) if spec else "-",
            f"{spec.cpu:g}" if spec else "-",
            f"{spec.memory_mb} MiB" if spec else "-",
            _relative(s.created_at, now),
            _relative(s.expires_at, now) if s.state in ("running", "paused", "creating") else "-",
        )
    return table


def sandbox_details(info: SandboxInfo) -> Table:
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    spec = info.spec
    rows: list[tuple[str, str]] = [
        ("id", info.id),
        ("state", info.state),
        ("project", info.project or "-"),
        ("owner", info.owner or "-"),
        ("edge", info.edge_id or "-"),
        ("created", info.created_at.isoformat() if info.created_at else "-"),
        ("started", info.started_at.isoformat() if info.started_at else "-"),
        ("expires", info.expires_at.isoformat() if info.expires_at else "-"),
    ]
    if info.error:
        rows.append(("error", info.error))
    if info.moved_to:
        rows.append(("moved to", info.moved_to))
    if spec:
        rows += [
            ("backend", spec.backend),
            ("image", spec.image),
            ("cpu", f"{spec.cpu:g}"),
            ("memory", f"{spec.memory_mb} MiB"),
            ("pids", str(spec.pids) if spec.pids is not None else "-"),
            ("timeout", f"{spec.timeout_s} s"),
        ]
        rows += [(f"env {k}", v) for k, v in sorted(spec.env.items())]
        rows += [(f"meta {k}", v) for k, v in sorted(spec.metadata.items())]
        for which in ("allow", "deny"):
            rules = spec.network.get(which) or []
            if rules or which == "allow":
                rows.append((f"network {which}", " ".join(rules) or "(nothing)"))
    rows += [(f"net {k}", str(v)) for k, v in sorted(info.network_stats.items())]
    for key, value in rows:
        shown = escape(value)
        table.add_row(escape(key), f"[red]{shown}[/red]" if key == "error" else shown)
    return table


def simple_table(columns: list[str], rows: list[list[str]]) -> Table:
    table = Table(box=None, header_style="bold")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    return table
