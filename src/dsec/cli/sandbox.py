"""``dsec sandbox ...``: create, list, inspect, run commands in, open shells in, and kill
sandboxes. Every command takes ``--json``; exec and shell exit with the remote status."""

from __future__ import annotations

import click

from dsec.cli import files as files_cmd
from dsec.cli import portforward, terminal
from dsec.cli.output import (
    EXIT_TIMEOUT,
    json_option,
    parse_pairs,
    print_json,
    report,
    sandbox_details,
    sandbox_table,
    state,
    stderr,
    stdout,
)
from dsec.core.errors import InvalidArgument
from dsec.core.spec import BACKENDS
from dsec.sdk import Sandbox
from dsec.sdk.runtime_calls import Command


@click.group("sandbox")
def sandbox_group() -> None:
    """Create, use and remove sandboxes."""


sandbox_group.add_command(files_cmd.files_group)
sandbox_group.add_command(portforward.port_forward)


RULE_HELP = (
    "Allow rule: CIDR, CIDR:PORT[-PORT][/udp], DOMAIN, *.DOMAIN, or from:CIDR[:PORT] "
    "(connections in) (repeatable)."
)


FROM_SNAPSHOT_DECIDES = ("image", "backend", "cpu", "memory", "pids", "env", "allow", "deny")


@sandbox_group.command("create")
@click.option("--image", default="base", show_default=True, help="Image to start from.")
@click.option(
    "--backend",
    default="container",
    show_default=True,
    type=click.Choice(list(BACKENDS)),
    help="Execution substrate (`dsec backends` shows what each edge offers).",
)
@click.option("--cpu", type=float, default=1.0, show_default=True, help="CPU cores.")
@click.option("--memory", type=int, default=512, show_default=True, help="Memory in MiB.")
@click.option("--pids", type=int, default=None, help="Process limit (server default if unset).")
@click.option("--timeout", type=int, default=300, show_default=True, help="Lifetime in seconds.")
@click.option("--env", "env", multiple=True, metavar="K=V", help="Environment (repeatable).")
@click.option("--meta", "meta", multiple=True, metavar="K=V", help="Metadata (repeatable).")
@click.option("--project", default=None, help="Project path (default: the key's project).")
@click.option("--allow", "allow", multiple=True, metavar="RULE", help=RULE_HELP)
@click.option("--deny", "deny", multiple=True, metavar="RULE", help="Deny rule (wins; repeatable).")
@click.option(
    "--trajectory", default=None, help="Record calls into this trajectory (or replay it)."
)
@click.option(
    "--on-mismatch",
    type=click.Choice(["diverge", "fail"]),
    default="diverge",
    show_default=True,
    help="When a replayed call differs from the log.",
)
@click.option(
    "--checkpoint-every", type=int, default=0, show_default=True, help="Checkpoint every N steps."
)
@click.option(
    "--from-snapshot",
    "snapshot_id",
    default=None,
    metavar="SNAPSHOT_ID",
    help="Start from this named snapshot (dsec snapshot ls); it decides backend, image, CPU "
    "and memory.",
)
@click.option(
    "--edge",
    default=None,
    metavar="EDGE_ID",
    help="With --from-snapshot: start on this edge (a full snapshot is copied there first).",
)
@json_option
def create(
    image: str,
    backend: str,
    cpu: float,
    memory: int,
    pids: int | None,
    timeout: int,
    env: tuple[str, ...],
    meta: tuple[str, ...],
    project: str | None,
    allow: tuple[str, ...],
    deny: tuple[str, ...],
    trajectory: str | None,
    on_mismatch: str,
    checkpoint_every: int,
    snapshot_id: str | None,
    edge: str | None,
    as_json: bool,
) -> None:
    """Create a sandbox and print its id (its network allows nothing unless --allow)."""
    env_map, meta_map = parse_pairs(env, "--env"), parse_pairs(meta, "--meta")
    if edge is not None and snapshot_id is None:
        raise click.UsageError("--edge goes with --from-snapshot")
    client = state().client()
    if snapshot_id is not None:
        ctx = click.get_current_context()
        given = [
            f"--{n.replace('_', '-')}"
            for n in FROM_SNAPSHOT_DECIDES
            if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise click.UsageError(f"--from-snapshot decides these: drop {', '.join(given)}")
        with stderr().status(f"creating a sandbox from snapshot {snapshot_id}"):
            sbx = Sandbox.from_snapshot(
                snapshot_id, timeout, meta_map, project=project, edge=edge, client=client
            )
    else:
        with stderr().status(f"creating a {backend} sandbox from {image!r}"):
            sbx = Sandbox.create(
                backend=backend,
                image=image,
                cpu=cpu,
                memory_mb=memory,
                pids=pids,
                timeout=timeout,
                env=env_map,
                metadata=meta_map,
                project=project,
                network={"allow": list(allow), "deny": list(deny)} if allow or deny else None,
                trajectory=trajectory,
                on_mismatch=on_mismatch,
                checkpoint_every=checkpoint_every,
                client=client,
            )
    if as_json:
        print_json(sbx.info())
    else:
        click.echo(sbx.id)


@sandbox_group.command("ls")
@click.option("--all", "show_all", is_flag=True, help="Include stopped and failed sandboxes.")
@json_option
def list_sandboxes(show_all: bool, as_json: bool) -> None:
    """List your sandboxes."""
    infos = state().client().list_sandboxes(all=show_all)
    if as_json:
        print_json(infos)
    elif not infos:
        stderr().print("no sandboxes" + ("" if show_all else " running (see --all)"))
    else:
        stdout().print(sandbox_table(infos))


@sandbox_group.command("info")
@click.argument("sandbox_id")
@json_option
def info(sandbox_id: str, as_json: bool) -> None:
    """Show one sandbox."""
    details = state().client().get_sandbox(sandbox_id)
    if as_json:
        print_json(details)
    else:
        stdout().print(sandbox_details(details))


def _batch(action: str, done: str, ids: tuple[str, ...], project: str | None,
           as_json: bool, *, single_object: bool = False) -> None:  # fmt: skip
    """One batch call for ``ids`` or ``--project``. Successes print (``--json``: the list of
    their SandboxInfo, or the one object when ``single_object`` and one id was given);
    each failure is reported on stderr; the exit code is the worst failure's."""
    if bool(ids) == (project is not None):
        raise click.UsageError("give sandbox ids or --project, not both and not neither")
    results = state().client().batch_sandboxes(action, ids=list(ids) or None, project=project)
    worst = 0
    for r in results:
        if r.error is not None:
            worst = max(worst, report(r.error))
        elif not as_json:
            click.echo(f"{done} {r.id}")
    infos = [r.sandbox for r in results if r.sandbox is not None]
    if as_json and single_object and len(ids) == 1:
        if infos:
            print_json(infos[0])
    elif as_json:
        print_json(infos)
    elif not results:
        stderr().print(f"no live sandboxes in project {project}")
    if worst:
        raise click.exceptions.Exit(worst)


PROJECT_HELP = "Every live sandbox of this project (and its subprojects) instead of ids."


@sandbox_group.command("kill")
@click.argument("sandbox_ids", nargs=-1, metavar="[ID...]")
@click.option("--project", default=None, help=PROJECT_HELP)
@json_option
def kill(sandbox_ids: tuple[str, ...], project: str | None, as_json: bool) -> None:
    """Stop and remove sandboxes, in one call (each one is tried; failures are reported)."""
    _batch("kill", "killed", sandbox_ids, project, as_json)


@sandbox_group.command("pause")
@click.argument("sandbox_ids", nargs=-1, metavar="[ID...]")
@click.option("--project", default=None, help=PROJECT_HELP)
@json_option
def pause(sandbox_ids: tuple[str, ...], project: str | None, as_json: bool) -> None:
    """Freeze every process of sandboxes (memory is kept; `resume` thaws them)."""
    _batch("pause", "paused", sandbox_ids, project, as_json, single_object=True)


@sandbox_group.command("resume")
@click.argument("sandbox_ids", nargs=-1, metavar="[ID...]")
@click.option("--project", default=None, help=PROJECT_HELP)
@click.option(
    "--edge",
    default=None,
    metavar="EDGE",
    help="Resume one paused microVM on this edge (it moves there under a new id).",
)
@json_option
def resume(
    sandbox_ids: tuple[str, ...], project: str | None, edge: str | None, as_json: bool
) -> None:
    """Thaw paused sandboxes."""
    if edge is None:
        _batch("resume", "resumed", sandbox_ids, project, as_json, single_object=True)
        return
    if len(sandbox_ids) != 1 or project is not None:
        raise click.UsageError("--edge resumes one sandbox: give exactly one id")
    old = sandbox_ids[0]
    with stderr().status(f"moving {old} to edge {edge} (copying its memory snapshot)..."):
        moved = state().client().sandbox(old).resume(edge=edge)
    if as_json:
        print_json(moved)
    else:
        click.echo(f"resumed {old} on edge {moved.edge_id} as {moved.id}")


@sandbox_group.command("network")
@click.argument("sandbox_id")
@click.option("--allow", "allow", multiple=True, metavar="RULE", help=RULE_HELP)
@click.option("--deny", "deny", multiple=True, metavar="RULE", help="Deny rule (wins; repeatable).")
@json_option
def set_network(
    sandbox_id: str, allow: tuple[str, ...], deny: tuple[str, ...], as_json: bool
) -> None:
    """Replace a running sandbox's network policy (no rules: deny everything)."""
    details = (
        state().client().sandbox(sandbox_id).set_network({"allow": list(allow), "deny": list(deny)})
    )
    if as_json:
        print_json(details)
    else:
        stdout().print(sandbox_details(details))


@sandbox_group.command("timeout")
@click.argument("sandbox_id")
@click.argument("seconds", type=click.IntRange(min=1))
@json_option
def set_timeout(sandbox_id: str, seconds: int, as_json: bool) -> None:
    """Let a sandbox live SECONDS from now."""
    details = state().client().sandbox(sandbox_id).set_timeout(seconds)
    if as_json:
        print_json(details)
    else:
        expires = details.expires_at.isoformat() if details.expires_at else "unknown"
        click.echo(f"{sandbox_id} now expires at {expires}")


def _command(argv: tuple[str, ...]) -> Command:
    if argv[:1] == ("--",):
        argv = argv[1:]
    if not argv:
        raise click.UsageError("give the command after --, e.g. dsec sandbox exec ID -- ls -l")
    return argv[0] if len(argv) == 1 else list(argv)


@sandbox_group.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD...")
@click.option("--timeout", type=float, default=60, show_default=True, help="Seconds to allow.")
@click.option("--env", "env", multiple=True, metavar="K=V", help="Environment (repeatable).")
@click.option("--cwd", default=None, help="Working directory.")
@click.option("--user", default=None, help="User name or uid.")
@json_option
def exec_(
    sandbox_id: str,
    cmd: tuple[str, ...],
    timeout: float,
    env: tuple[str, ...],
    cwd: str | None,
    user: str | None,
    as_json: bool,
) -> None:
    """Run a command, streaming its output, and exit with its exit status.

    One argument runs through ``/bin/sh -c`` (so ``'echo $HOME | wc'`` works); several are
    executed directly. Piped stdin is forwarded. With --json the output is collected and
    printed with the exit status as one JSON object. A timeout exits with 124.
    """
    command = _command(cmd)
    env_map = parse_pairs(env, "--env") or None
    sbx = state().client().sandbox(sandbox_id)
    events = sbx.exec_stream(
        command, env=env_map, cwd=cwd, user=user, timeout=timeout, stdin=terminal.stdin_for_exec()
    )
    if as_json:
        result = terminal.collect_output(events)
        print_json(result)
        code = EXIT_TIMEOUT if result.timed_out else terminal.exit_status(result)
        raise click.exceptions.Exit(code)
    final = terminal.stream_output(events)
    if final.timed_out:
        click.echo(f"dsec: command timed out after {timeout:g} s", err=True)
        raise click.exceptions.Exit(EXIT_TIMEOUT)
    raise click.exceptions.Exit(terminal.exit_status(final))


@sandbox_group.command("shell")
@click.argument("sandbox_id")
@click.option("--cmd", default=None, help="Program to run instead of a login shell.")
@click.option("--cwd", default=None, help="Working directory.")
def shell(sandbox_id: str, cmd: str | None, cwd: str | None) -> None:
    """Open an interactive terminal in a sandbox (also works with piped stdin)."""
    sbx = state().client().sandbox(sandbox_id)
    cols, rows = terminal.terminal_size()
    if cmd is not None and not cmd.strip():
        raise InvalidArgument("--cmd must not be empty")
    pty = sbx.pty.create(cols=cols, rows=rows, cmd=cmd, cwd=cwd)
    raise click.exceptions.Exit(terminal.run_pty_session(pty))
