"""A fake execution backend for edge unit tests.

It implements :class:`dsec.edge.backends.api.Backend` in memory and answers the runtime
protocol's ``ping`` on each sandbox's socket, so the edge's lifecycle code runs unchanged.
The container backend passes the same lifecycle tests end to end (``tests/e2e``).
"""

from __future__ import annotations

import asyncio
import contextlib

from dsec.agent import protocol
from dsec.core.errors import SandboxFailed
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import (
    Availability,
    Capabilities,
    RuntimeState,
    SandboxPaths,
    Started,
)


class FakeBackend:
    name = "container"

    def __init__(self) -> None:
        self.running: dict[str, asyncio.AbstractServer] = {}
        self.inits: dict[str, asyncio.subprocess.Process] = {}
        self.states: dict[str, RuntimeState] = {}
        self.destroyed: list[str] = []
        self.fail_next_create: str = ""
        self.create_delay = 0.0

    def availability(self) -> Availability:
        return Availability(True, "fake")

    def capabilities(self) -> Capabilities:
        return Capabilities(pause=True, persistent_processes=True, notes="fake")

    async def create(self, sandbox_id: str, spec: SandboxSpec, paths: SandboxPaths) -> Started:
        if self.create_delay:
            await asyncio.sleep(self.create_delay)
        if self.fail_next_create:
            msg, self.fail_next_create = self.fail_next_create, ""
            raise SandboxFailed(msg)
        paths.agent_socket.parent.mkdir(parents=True, exist_ok=True)
        self.running[sandbox_id] = await asyncio.start_unix_server(
            _answer_ping, path=str(paths.agent_socket)
        )
        self.states[sandbox_id] = RuntimeState.RUNNING
        # A real process stands in for the sandbox's init, so pid watching is real too.
        init = await asyncio.create_subprocess_exec("sleep", "100000")
        self.inits[sandbox_id] = init
        return Started(pid=init.pid)

    async def state(self, sandbox_id: str) -> tuple[RuntimeState, int]:
        st = self.states.get(sandbox_id, RuntimeState.MISSING)
        init = self.inits.get(sandbox_id)
        if init is None or init.returncode is not None:
            return (RuntimeState.MISSING, 0)
        return st, init.pid

    async def pause(self, sandbox_id: str) -> None:
        self.states[sandbox_id] = RuntimeState.PAUSED

    async def resume(self, sandbox_id: str) -> None:
        self.states[sandbox_id] = RuntimeState.RUNNING

    async def destroy(self, sandbox_id: str, paths: SandboxPaths) -> None:
        server = self.running.pop(sandbox_id, None)
        if server is not None:
            server.close()
            await server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            paths.agent_socket.unlink()
        self.states.pop(sandbox_id, None)
        init = self.inits.pop(sandbox_id, None)
        if init is not None and init.returncode is None:
            init.kill()
            await init.wait()
        self.destroyed.append(sandbox_id)

    async def aclose(self) -> None:
        """Destroy whatever a test left running (its sockets live under the test's tmp)."""
        for sid in list(self.running):
            server = self.running.pop(sid)
            server.close()
        for init in self.inits.values():
            if init.returncode is None:
                init.kill()
                await init.wait()
        self.inits.clear()

    async def usage(self, sandbox_id: str) -> dict[str, float]:
        return {}

    def release_host_setup(self) -> None:
        pass


async def _answer_ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readexactly(protocol.HEADER.size)
        length, _ = protocol.parse_header(head)
        await reader.readexactly(length)
        writer.write(protocol.result({"version": "fake"}))
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
