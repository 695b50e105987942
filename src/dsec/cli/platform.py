"""Platform commands: ``dsec setup``, ``dsec up``, ``dsec down``, ``dsec status``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console

from dsec.paths import Paths
from dsec.supervisor import (
    COMPONENTS,
    Layout,
    api_args,
    healthy,
    layout_path,
    run_foreground,
)

_err = Console(stderr=True)
_out = Console()

home_option = click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    envvar="DSEC_HOME",
    help="State directory (default /var/lib/dsec).",
)


def _setup(
    paths: Paths, *, quiet: bool = False, vm_image: bool = False, kernel: bool = True
) -> None:
    from dsec.agent.bundle import build_bundle
    from dsec.edge.images.base import build_base_image
    from dsec.edge.images.store import ImageStore

    with _err.status("preparing the agent bundle") as st:

        def progress(msg: str) -> None:
            st.update(msg)
            if not quiet:
                _err.log(msg)

        build_bundle(paths.agent_bundle, progress=progress)
        st.update("preparing the base image (Debian bookworm minbase + python3)")
        build_base_image(ImageStore(paths.images), progress=progress)
        _setup_function(paths, progress)
        _setup_microvm(paths, progress, kernel=kernel)
        _setup_vm_image(paths, progress, build=vm_image)


def _setup_function(paths: Paths, progress: Callable[[str], None]) -> None:
    """The function workers' zygote (a small C program; the pool also builds it if missing)."""
    from dsec.edge.backends.function import zygote

    progress("building the function zygote")
    zygote.binary(paths.data)


def _setup_microvm(paths: Paths, progress: Callable[[str], None], *, kernel: bool) -> None:
    """The microVM guest kernel and shared images (skipped without linux-source)."""
    from dsec.edge.backends.microvm import setup as vm_setup

    why = vm_setup.missing()
    if why:
        progress(f"microVM backend skipped: {why}")
        return
    vm_setup.prepare(paths, progress, build_kernel=kernel)


def _setup_vm_image(paths: Paths, progress: Callable[[str], None], *, build: bool) -> None:
    """The vm backend's system image: built with --vm-image (minutes), then kept in step
    with the agent bundle on every setup (seconds when only the bundle changed)."""
    from dsec.edge.backends.vm import image

    if not build and not image.built_before(paths.data):
        return
    why = image.missing()
    if why:
        progress(f"VM image skipped: {why}")
        return
    image.build_image(paths.data, paths.agent_bundle, progress=progress)


@click.command()
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    envvar="DSEC_DATA",
    help="Where images and the agent bundle live (default /var/lib/dsec).",
)
@click.option(
    "--code-interpreter",
    is_flag=True,
    help="Also build the code-interpreter-v1 image (pip installs its packages on this host).",
)
@click.option(
    "--vm-image",
    is_flag=True,
    help="Also build the vm backend's Debian system image (a few minutes, then cached).",
)
@click.option(
    "--no-kernel",
    is_flag=True,
    help="Leave out the microVM guest kernel (about 11 min the first time; scripts/install "
    "builds it beside the rest with `python3 -m dsec.edge.backends.microvm.kernel`).",
)
def setup(data: Path | None, code_interpreter: bool, vm_image: bool, no_kernel: bool) -> None:
    """Build the agent bundle and the base image (cached; fast when already done)."""
    if data is not None:
        os.environ["DSEC_DATA"] = str(data)
    paths = Paths.from_env()
    _setup(paths, vm_image=vm_image, kernel=not no_kernel)
    if code_interpreter:
        from dsec.edge.images.store import ImageStore
        from dsec.interpreter.image import build_image

        with _err.status("building the code-interpreter image") as st:

            def progress(msg: str) -> None:
                st.update(msg)
                _err.log(msg, markup=False)

            image = build_image(
                ImageStore(paths.images),
                paths.data / "cache" / "code-interpreter",
                progress=progress,
            )
        _err.print(f"image {image.name}: {len(image.diff_ids)} layers")
    _err.print("[green]setup complete[/green]")


def _ready_message(paths: Paths, lay: Layout) -> None:
    _err.print(
        f"[green]OpenDsec is up[/green]: API http://{lay.apiserver} · edge {lay.edge_id} · "
        f"E2B gateway http://{lay.gateway} · admin key in {paths.home / 'admin.key'}"
    )


@click.command()
@home_option
@click.option("--detach", "-d", is_flag=True, help="Run in the background.")
@click.option(
    "--port-base",
    type=int,
    default=8420,
    show_default=True,
    help="apiserver on this port; iam, watcher, edge, metrics, E2B gateway on the next seven.",
)
@click.option(
    "--keep-sandboxes",
    is_flag=True,
    help="Leave sandboxes running on shutdown (re-adopted by the next `up`).",
)
@click.option(
    "--domain",
    default="",
    help="The apiserver serves <port>-<sandbox id>.DOMAIN (host-style routing to sandboxes).",
)
@click.option(
    "--tls-listen",
    default="",
    metavar="ADDR",
    help="The apiserver also serves HTTPS on ADDR with a *.DOMAIN certificate (needs --domain).",
)
def up(
    home: Path | None,
    detach: bool,
    port_base: int,
    keep_sandboxes: bool,
    domain: str,
    tls_listen: str,
) -> None:
    """Start iam, watcher, edge and apiserver on this machine."""
    if tls_listen and not domain:
        raise click.UsageError("--tls-listen needs --domain (the certificate's name)")
    paths = Paths.from_env(home)
    if paths.supervisor_pid.exists() and _alive(int(paths.supervisor_pid.read_text() or 0)):
        _err.print(f"OpenDsec is already running (home {paths.home}); see `dsec status`")
        return
    _setup(paths, quiet=True)
    if not detach:
        code = run_foreground(
            paths,
            Layout.from_port_base(port_base),
            keep_sandboxes=keep_sandboxes,
            echo=lambda s: _err.log(s),
            ready=lambda lay: _ready_message(paths, lay),
            api_args=api_args(domain, tls_listen),
        )
        sys.exit(code)
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.run.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "dsec.supervisor", str(paths.home), str(port_base)]
    if keep_sandboxes:
        argv.append("--keep-sandboxes")
    argv += api_args(domain, tls_listen)
    with open(paths.logs / "supervisor.log", "ab") as logf:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True
        )
    with _err.status("starting OpenDsec") as st:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (paths.logs / "supervisor.log").read_text()[-2000:]
                raise click.ClickException(f"the platform failed to start:\n{tail}")
            lay = _layout(paths)
            if lay and paths.supervisor_pid.exists() and healthy(lay.health_url("apiserver")):
                _ready_message(paths, lay)
                return
            st.update(f"starting OpenDsec ({', '.join(lay.pids) if lay else 'pki'})")
            time.sleep(0.1)
    raise click.ClickException("the platform did not become ready within 180 s")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _layout(paths: Paths) -> Layout | None:
    try:
        return Layout.load(layout_path(paths))
    except (OSError, ValueError, TypeError):
        return None


@click.command()
@home_option
def down(home: Path | None) -> None:
    """Stop the platform started by `dsec up` (and its sandboxes, unless it was started
    with --keep-sandboxes)."""
    paths = Paths.from_env(home)
    try:
        pid = int(paths.supervisor_pid.read_text())
    except (OSError, ValueError):
        _err.print("OpenDsec is not running")
        return
    if not _alive(pid):
        paths.supervisor_pid.unlink(missing_ok=True)
        _err.print("OpenDsec is not running (removed a stale pid file)")
        return
    os.kill(pid, signal.SIGTERM)
    with _err.status("stopping OpenDsec"):
        deadline = time.monotonic() + 120
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    if _alive(pid):
        raise click.ClickException(f"supervisor {pid} did not stop within 120 s")
    _err.print("OpenDsec stopped")


@click.command()
@home_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(home: Path | None, as_json: bool) -> None:
    """Show every component's address and health; exit 1 if anything is down."""
    paths = Paths.from_env(home)
    lay = _layout(paths)
    comps: dict[str, dict[str, object]] = {}
    for c in COMPONENTS:
        ok = lay is not None and healthy(lay.health_url(c))
        comps[c] = {
            "address": lay.address(c) if lay else None,
            "health_url": lay.health_url(c) if lay else None,
            "pid": lay.pids.get(c) if lay else None,
            "healthy": ok,
        }
    all_ok = lay is not None and all(v["healthy"] for v in comps.values())
    if as_json:
        click.echo(
            json.dumps(
                {
                    "running": lay is not None,
                    "healthy": all_ok,
                    "home": str(paths.home),
                    "edge_id": lay.edge_id if lay else None,
                    "components": comps,
                },
                indent=2,
            )
        )
    elif lay is None:
        _err.print(f"OpenDsec is not running (home {paths.home})")
    else:
        from rich.table import Table

        t = Table("component", "address", "pid", "health")
        for c, v in comps.items():
            t.add_row(
                c,
                str(v["address"]),
                str(v["pid"]),
                "[green]ok[/green]" if v["healthy"] else "[red]down[/red]",
            )
        _out.print(t)
    if not all_ok:
        sys.exit(1)


def register(cli: click.Group) -> None:
    for cmd in (setup, up, down, status):
        cli.add_command(cmd)
