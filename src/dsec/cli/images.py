"""``dsec image pull|save|load|import-vm|ls|rm|gc`` and ``dsec registry login|logout``.

Registry logins are kept in ``$DSEC_HOME/registries.json`` (mode 0600), the file the edge
on this machine reads too; ``dsec image pull`` also sends the stored (or Docker
``config.json``) credentials for the image's registry with the request, so edges on other
machines can use them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
)

from dsec.cli.output import json_option, print_json, simple_table, state, stderr, stdout
from dsec.cli.sandbox import sandbox_group
from dsec.edge.images.credentials import (
    RegistryCredentials,
    RegistrySettings,
    default_docker_configs,
)
from dsec.edge.images.reference import parse_reference
from dsec.paths import Paths


def settings_file() -> Path:
    return Paths.from_env().home / "registries.json"


def credentials() -> RegistryCredentials:
    return RegistryCredentials(settings_file(), default_docker_configs())


@click.group("image")
def image_group() -> None:
    """Images on the edges: pull from registries, build, save/load tarballs, list, remove, gc."""


@image_group.command("pull")
@click.argument("reference")
@click.option("--platform", default="", help="os/arch[/variant] of an index [linux/amd64].")
@click.option("--insecure", is_flag=True, help="Talk plain HTTP to the registry.")
@click.option("--edge", "edge_id", default="", help="Pull on this edge only.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@json_option
def pull(
    reference: str, platform: str, insecure: bool, edge_id: str, quiet: bool, as_json: bool
) -> None:
    """Pull REFERENCE (e.g. 127.0.0.1:5000/team/env:v1) onto the edges."""
    ref = parse_reference(reference)
    settings = credentials().lookup(ref.registry)
    show = not quiet and not as_json and sys.stderr.isatty()
    bars: dict[tuple[str, str], TaskID] = {}
    progress = _progress(show)

    def report(p: dict[str, Any]) -> None:
        key = (str(p.get("edge_id", "")), str(p.get("digest", "")))
        total = int(p.get("total", 0)) if int(p.get("total", 0)) > 0 else None
        if key not in bars:
            label = f"{key[0]} {key[1].removeprefix('sha256:')[:12]}"
            bars[key] = progress.add_task(label, total=total, status="")
        progress.update(bars[key], completed=int(p.get("done", 0)), status=p.get("status", ""))

    with progress:
        images = (
            state()
            .client()
            .pull_image(
                reference,
                platform=platform,
                insecure=insecure or settings.insecure,
                username=settings.username,
                password=settings.password,
                edge_id=edge_id,
                progress=report,
            )
        )
    if as_json:
        print_json(images)
        return
    for img in images:
        click.echo(f"{img['edge_id']}: {img['name']} ({len(img['layers'])} layers)")


@image_group.command("build")
@click.argument("context", type=click.Path(exists=True, file_okay=False))
@click.option("-t", "--tag", required=True, help="Name of the built image.")
@click.option("-f", "--file", "dockerfile", default=None, help="Dockerfile [CONTEXT/Dockerfile].")
@click.option("--build-arg", "build_args", multiple=True, help="NAME=value for an ARG.")
@click.option("--no-cache", is_flag=True, help="Run every step again.")
@click.option("--edge", "edge_id", default="", help="Build on this edge.")
@click.option("--quiet", "-q", is_flag=True, help="No step output, only the result.")
@json_option
def build(
    context: str,
    tag: str,
    dockerfile: str | None,
    build_args: tuple[str, ...],
    no_cache: bool,
    edge_id: str,
    quiet: bool,
    as_json: bool,
) -> None:
    """Build image TAG from a Dockerfile; RUN steps run in sandboxes on an edge."""
    args: dict[str, str] = {}
    for item in build_args:
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise click.BadParameter(f"expected NAME=value, got {item!r}", param_hint="--build-arg")
        args[key] = value
    err = stderr()

    def report(ev: dict[str, Any]) -> None:
        if quiet or as_json:
            return
        if "step" in ev:
            st = ev["step"]
            err.print(f"Step {st['index']}/{st['total']} : {st['instruction']}", markup=False)
        elif ev.get("cached"):
            err.print(" ---> CACHED", markup=False)
        elif "log" in ev:
            err.file.write(str(ev["log"]))
            err.file.flush()

    image = (
        state()
        .client()
        .build_image(
            context,
            tag,
            dockerfile=dockerfile,
            build_args=args,
            no_cache=no_cache,
            edge_id=edge_id,
            progress=report,
        )
    )
    if as_json:
        print_json(image)
        return
    click.echo(f"Built {image['name']} on {image['edge_id']} ({len(image['layers'])} layers)")


def _progress(show: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[status]}"),
        console=stderr(),
        disable=not show,
        transient=False,
    )


@image_group.command("save")
@click.argument("name")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="FILE.tar")
@click.option("--edge", "edge_id", default="", help="Save from this edge.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
def save(name: str, output: str, edge_id: str, quiet: bool) -> None:
    """Write image NAME to an OCI image-layout tarball (for `dsec image load`, skopeo...)."""
    progress = _progress(not quiet and sys.stderr.isatty())
    with progress:
        task = progress.add_task(name, total=None, status="saving")
        size = (
            state()
            .client()
            .save_image(
                name,
                output,
                edge_id=edge_id,
                progress=lambda n: progress.update(task, completed=n),
            )
        )
        progress.update(task, status="done")
    click.echo(f"saved {name} to {output} ({size / (1 << 20):.1f} MiB)")


@image_group.command("load")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", default="", help="Store the (single) image under this name.")
@click.option("--edge", "edge_id", default="", help="Load onto this edge [the first].")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@json_option
def load(file: str, name: str, edge_id: str, quiet: bool, as_json: bool) -> None:
    """Import the images of an OCI image-layout tarball FILE (every blob is verified)."""
    progress = _progress(not quiet and not as_json and sys.stderr.isatty())
    bars: dict[str, TaskID] = {}

    def report(p: dict[str, Any]) -> None:
        digest = str(p.get("digest", ""))
        total = int(p.get("total", 0)) or None
        if digest not in bars:
            bars[digest] = progress.add_task(
                digest.removeprefix("sha256:")[:12], total=total, status=""
            )
        progress.update(bars[digest], completed=int(p.get("done", 0)), status=p.get("status"))

    with progress:
        images = state().client().load_image(file, name=name, edge_id=edge_id, progress=report)
    if as_json:
        print_json(images)
        return
    for img in images:
        click.echo(f"{img['edge_id']}: {img['name']} ({len(img['layers'])} layers)")


@image_group.command("import-vm")
@click.argument("name")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--edge", "edge_id", default="", help="Import onto this edge [the first].")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@json_option
def import_vm(name: str, file: str, edge_id: str, quiet: bool, as_json: bool) -> None:
    """Import the bootable disk FILE (raw or qcow2 with its own kernel and systemd, e.g. a
    Debian or Ubuntu cloud image) as vm system image NAME: then
    `dsec sandbox create --backend vm --image NAME`."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[status]}"),
        console=stderr(),
        disable=quiet or as_json or not sys.stderr.isatty(),
    )
    upload = progress.add_task("upload", total=None, status="")
    steps = progress.add_task("import", total=None, status="waiting", visible=False)

    def report(p: dict[str, Any]) -> None:
        done, total = int(p.get("done", 0)), int(p.get("total", 0)) or None
        if p.get("digest") == "upload":
            status = f"{done / (1 << 20):.0f} MiB"
            progress.update(upload, completed=done, total=total, status=status)
        else:
            progress.update(steps, completed=done, total=total, status=p.get("status", ""),
                            visible=True)  # fmt: skip

    with progress:
        image = state().client().import_vm_image(file, name, edge_id=edge_id, progress=report)
    if as_json:
        print_json(image)
        return
    click.echo(f"imported {image['name']} on {image['edge_id']}: {image['source']}")


@image_group.command("ls")
@json_option
def list_images(as_json: bool) -> None:
    """List images on every edge."""
    images = state().client().list_images()
    if as_json:
        print_json(images)
        return
    rows = [
        [i["name"], i["edge_id"], "vm disk" if i.get("backend") == "vm" else str(len(i["layers"])),
         i.get("workdir", ""), i["created"]]
        for i in images
    ]  # fmt: skip
    stdout().print(simple_table(["NAME", "EDGE", "LAYERS", "WORKDIR", "CREATED"], rows))


@image_group.command("rm")
@click.argument("name")
@json_option
def remove(name: str, as_json: bool) -> None:
    """Forget image NAME on every edge (its layers go at the next gc; an imported VM
    image is deleted at once)."""
    res = state().client().remove_image(name)
    if as_json:
        print_json(res)
    else:
        click.echo(f"removed {name} from {res.get('removed', 0)} edge(s)")


@image_group.command("gc")
@json_option
def gc(as_json: bool) -> None:
    """Delete layers and blobs no image uses (layers of running sandboxes stay)."""
    res = state().client().gc_images()
    if as_json:
        print_json(res)
        return
    for e in res.get("edges", []):
        mib = int(e["bytes_freed"]) / (1 << 20)
        click.echo(f"{e['edge_id']}: {e['layers']} layers, {e['blobs']} blobs, {mib:.1f} MiB")


@click.group("registry")
def registry_group() -> None:
    """Registry logins and settings (stored 0600 in $DSEC_HOME/registries.json)."""


@registry_group.command("login")
@click.argument("registry")
@click.option("--username", "-u", prompt=True)
@click.option("--password", "-p", prompt=True, hide_input=True)
@click.option("--insecure", is_flag=True, help="This registry speaks plain HTTP.")
@click.option("--ca-file", default="", help="CA bundle to verify the registry's TLS.")
def login(registry: str, username: str, password: str, insecure: bool, ca_file: str) -> None:
    """Store credentials for REGISTRY (host[:port])."""
    creds = RegistryCredentials(settings_file())
    creds.save(registry, RegistrySettings(username, password, insecure, ca_file))
    click.echo(f"stored credentials for {registry} in {settings_file()}")


@registry_group.command("logout")
@click.argument("registry")
def logout(registry: str) -> None:
    """Forget REGISTRY's credentials and settings."""
    known = RegistryCredentials(settings_file()).remove(registry)
    click.echo(f"{'removed' if known else 'no entry for'} {registry}")


@sandbox_group.command("pack")
@click.argument("sandbox_id", metavar="ID")
@click.argument("name")
@click.option("--push", is_flag=True, help="Then push it to the registry NAME names.")
@click.option("--insecure", is_flag=True, help="Push over plain HTTP.")
@json_option
def pack(sandbox_id: str, name: str, push: bool, insecure: bool, as_json: bool) -> None:
    """Record sandbox ID's changes as a new image NAME on top of its image."""
    settings = credentials().lookup(parse_reference(name).registry) if push else None
    image = (
        state()
        .client()
        .sandbox(sandbox_id)
        .pack(
            name,
            push=push,
            insecure=insecure or bool(settings and settings.insecure),
            username=settings.username if settings else "",
            password=settings.password if settings else "",
        )
    )
    if as_json:
        print_json(image)
    else:
        click.echo(f"{image['edge_id']}: {image['name']} ({len(image['layers'])} layers)")
