"""``dsec sandbox port-forward ID [ADDR:]LOCAL:REMOTE``: a local port that reaches a sandbox port.

Every accepted connection becomes one raw TCP stream to ``REMOTE`` inside the sandbox
(``AsyncSandbox.connect_tcp``), so nothing in the sandbox's network policy has to allow it.
``LOCAL`` 0 picks a free port; the listening address is printed on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib

import click

from dsec.agent.protocol import CHUNK
from dsec.cli.output import state
from dsec.core.errors import DsecError, InvalidArgument
from dsec.sdk import AsyncClient, AsyncSandbox, AsyncTcpStream
from dsec.sdk.config import resolve_config


def parse_spec(spec: str) -> tuple[str, int, int]:
    """``[ADDR:]LOCAL:REMOTE`` as ``(addr, local, remote)``; the address defaults to loopback."""
    parts = spec.split(":")
    if len(parts) < 2 or not (parts[-2].isdigit() and parts[-1].isdigit()):
        raise InvalidArgument(f"expected [ADDR:]LOCAL:REMOTE with numeric ports, got {spec!r}")
    addr = ":".join(parts[:-2]).strip("[]") or "127.0.0.1"
    local, ports = parts[-2], parts[-1]
    lport, rport = int(local), int(ports)
    if not (0 <= lport <= 65535 and 1 <= rport <= 65535):
        raise InvalidArgument(f"ports out of range in {spec!r} (LOCAL 0-65535, REMOTE 1-65535)")
    return addr, lport, rport


async def _to_sandbox(reader: asyncio.StreamReader, tcp: AsyncTcpStream) -> None:
    while data := await reader.read(CHUNK):
        await tcp.send(data)
    await tcp.close_write()


async def _from_sandbox(tcp: AsyncTcpStream, writer: asyncio.StreamWriter) -> None:
    async for chunk in tcp:
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _forward(
    sbx: AsyncSandbox, remote: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    peer = writer.get_extra_info("peername")
    try:
        tcp = await sbx.connect_tcp(remote)
    except DsecError as exc:
        click.echo(f"dsec: connection from {peer}: {exc.message}", err=True)
        writer.close()
        return
    up = asyncio.create_task(_to_sandbox(reader, tcp))
    try:
        await _from_sandbox(tcp, writer)
        # The server closed its side: the client may still be sending; give it a moment.
        with contextlib.suppress(TimeoutError, DsecError, ConnectionError):
            await asyncio.wait_for(asyncio.shield(up), 1.0)
    except (DsecError, ConnectionError) as exc:
        click.echo(f"dsec: connection from {peer}: {exc}", err=True)
    finally:
        up.cancel()
        with contextlib.suppress(BaseException):
            await up
        await tcp.aclose()
        writer.close()
    result = tcp.result or {}
    click.echo(
        f"dsec: connection from {peer} closed "
        f"(sent {result.get('sent', '?')}, received {result.get('received', '?')} bytes)",
        err=True,
    )


async def serve(sandbox_id: str, addr: str, local: int, remote: int) -> None:
    st = state()
    client = AsyncClient(config=resolve_config(st.api_url, st.api_key, environ=st.environ))
    try:
        await client.get_sandbox(sandbox_id)  # a clear error before listening
        sbx = client.sandbox(sandbox_id)
        try:
            server = await asyncio.start_server(
                lambda r, w: _forward(sbx, remote, r, w), addr, local
            )
        except OSError as exc:
            raise InvalidArgument(f"cannot listen on {addr}:{local}: {exc.strerror}") from None
        async with server:
            bound = server.sockets[0].getsockname()
            click.echo(f"forwarding {bound[0]}:{bound[1]} -> {sandbox_id} port {remote}")
            await server.serve_forever()
    finally:
        await client.aclose()


@click.command("port-forward")
@click.argument("sandbox_id")
@click.argument("spec", metavar="[ADDR:]LOCAL:REMOTE")
def port_forward(sandbox_id: str, spec: str) -> None:
    """Forward connections to a local port to a port inside the sandbox (until Ctrl-C)."""
    addr, local, remote = parse_spec(spec)
    asyncio.run(serve(sandbox_id, addr, local, remote))
