"""A build's RUN step in a real sandbox of this edge (the ``RunStep`` of the builder)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from dsec.agent.protocol import KIND_ERR, KIND_OUT
from dsec.core.errors import DsecError
from dsec.core.ids import new_sandbox_id
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.images.build import OUTPUT_TAIL, BuildOptions, RunResult
from dsec.edge.manager import Caller, SandboxManager


class SandboxSteps:
    """Makes one sandbox per RUN, as ``caller``, and kills it afterwards whatever happens."""

    def __init__(self, manager: SandboxManager, caller: Caller, opts: BuildOptions) -> None:
        self.manager = manager
        self.caller = caller
        self.opts = opts

    @contextlib.asynccontextmanager
    async def __call__(
        self,
        image: str,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        output: Callable[[bytes], None],
    ) -> AsyncIterator[tuple[RunResult, Path]]:
        m = self.manager
        sid = new_sandbox_id(m.edge_id, os.urandom(13))
        spec = SandboxSpec(
            image=image,
            memory_mb=self.opts.memory_mb,
            timeout_s=self.opts.timeout_s + 300,
            metadata={"dsec.build": self.opts.tag[:200]},
        )
        await m.create(
            sid,
            spec,
            project=self.caller.project,
            owner=self.caller.subject or "build",
            caller=self.caller,
        )
        paused = False
        backend = m.backend(spec.backend)
        try:
            request = {
                "op": "exec",
                "cmd": argv,
                "env": env,
                "cwd": cwd,
                "timeout": self.opts.timeout_s,
            }
            stream = await agent_client.open_stream(m.paths(sid).agent_socket, request)
            tail = bytearray()
            try:
                async for kind, payload in stream:
                    if stream.final is not None:
                        break
                    if kind in (KIND_OUT, KIND_ERR):
                        output(payload)
                        tail += payload
                        del tail[:-OUTPUT_TAIL]
            finally:
                await stream.aclose()
            final = agent_client.raise_for_final(stream.final or {})
            code = int(final.get("exit_code") or 0)
            if final.get("timed_out"):
                tail += f"\n(timed out after {self.opts.timeout_s} s)".encode()
            if code == 0:
                await backend.pause(sid)  # a still upper dir while it is packed
                paused = True
            yield RunResult(code, bytes(tail)), m.paths(sid).state_dir / "upper"
        finally:
            if paused:
                with contextlib.suppress(DsecError):
                    await backend.resume(sid)
            await m.kill(sid, self.caller, reason="build step done")
