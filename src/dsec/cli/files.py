"""``dsec sandbox files ...``: list, print, upload and download files of a sandbox.

Transfers stream in chunks in both directions; ``-`` stands for stdin/stdout.
"""

from __future__ import annotations

import stat as stat_mod

import click

from dsec.cli import terminal
from dsec.cli.output import json_option, print_json, simple_table, state, stdout
from dsec.sdk.models import FileEntry


@click.group("files")
def files_group() -> None:
    """Work with the files of a sandbox."""


def _mode(entry: FileEntry) -> str:
    prefix = {"dir": "d", "symlink": "l"}.get(entry.type, "-")
    return prefix + stat_mod.filemode(entry.mode)[1:]


@files_group.command("ls")
@click.argument("sandbox_id")
@click.argument("path", default=".")
@click.option("--depth", type=click.IntRange(1, 32), default=1, show_default=True)
@json_option
def ls(sandbox_id: str, path: str, depth: int, as_json: bool) -> None:
    """List a directory (relative paths start at the user's home)."""
    entries = state().client().sandbox(sandbox_id).files.list(path, depth)
    if as_json:
        print_json(entries)
        return
    rows = [
        [
            _mode(e),
            str(e.size),
            e.mtime.strftime("%Y-%m-%d %H:%M") if e.mtime else "-",
            e.path + ("/" if e.is_dir else "") + (f" -> {e.target}" if e.target else ""),
        ]
        for e in entries
    ]
    stdout().print(simple_table(["MODE", "SIZE", "MODIFIED", "PATH"], rows))


@files_group.command("cat")
@click.argument("sandbox_id")
@click.argument("path")
def cat(sandbox_id: str, path: str) -> None:
    """Print a file to stdout (streamed)."""
    files = state().client().sandbox(sandbox_id).files
    for chunk in files.read_stream(path):
        terminal.write_stdout(chunk)


@files_group.command("put")
@click.argument("sandbox_id")
@click.argument("local", type=click.Path(dir_okay=False, allow_dash=True))
@click.argument("remote")
@click.option("--mode", default=None, help="Octal permissions, e.g. 755.")
@json_option
def put(sandbox_id: str, local: str, remote: str, mode: str | None, as_json: bool) -> None:
    """Upload LOCAL (or - for stdin) to REMOTE."""
    try:
        mode_bits = int(mode, 8) if mode is not None else None
    except ValueError:
        raise click.BadParameter(f"{mode!r} is not an octal mode", param_hint="--mode") from None
    files = state().client().sandbox(sandbox_id).files
    if local == "-":
        written = files.write(remote, terminal.binary_stdin(), mode=mode_bits)
    else:
        written = files.upload(local, remote, mode=mode_bits)
    if as_json:
        print_json(written)
    else:
        click.echo(f"{written.path}: {written.size} bytes")


@files_group.command("get")
@click.argument("sandbox_id")
@click.argument("remote")
@click.argument("local", type=click.Path(dir_okay=False, allow_dash=True))
@json_option
def get(sandbox_id: str, remote: str, local: str, as_json: bool) -> None:
    """Download REMOTE to LOCAL (or - for stdout)."""
    files = state().client().sandbox(sandbox_id).files
    if local == "-":
        for chunk in files.read_stream(remote):
            terminal.write_stdout(chunk)
        return
    size = files.download(remote, local)
    if as_json:
        print_json({"path": local, "size": size})
    else:
        click.echo(f"{local}: {size} bytes")


@files_group.command("mkdir")
@click.argument("sandbox_id")
@click.argument("path")
@json_option
def mkdir(sandbox_id: str, path: str, as_json: bool) -> None:
    """Create a directory (and missing parents)."""
    entry = state().client().sandbox(sandbox_id).files.mkdir(path)
    if as_json:
        print_json(entry)


@files_group.command("rm")
@click.argument("sandbox_id")
@click.argument("path")
@click.option("-r", "--recursive", is_flag=True, help="Remove directories and their contents.")
@json_option
def rm(sandbox_id: str, path: str, recursive: bool, as_json: bool) -> None:
    """Remove a file (or a directory with -r)."""
    state().client().sandbox(sandbox_id).files.remove(path, recursive)
    if as_json:
        print_json({"removed": path})
