"""The QMP client against a scripted QMP server on a unix socket (no QEMU needed)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from dsec.edge.backends.microvm.qmp import Qmp, QmpError


async def _server(path: Path, answers: dict[str, dict[str, Any]], seen: list[list[str]]) -> Any:
    """Greets, then answers each command by name; records what arrived in each read."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'{"QMP": {"version": {}, "capabilities": []}}\n')
        buf = b""
        while data := await reader.read(65536):
            buf += data
            *lines, buf = buf.split(b"\n")
            seen.append([json.loads(line)["execute"] for line in lines])
            for line in lines:
                name = json.loads(line)["execute"]
                if name == "migrate-incoming":  # an event between the replies
                    writer.write(b'{"event": "MIGRATION", "data": {"status": "setup"}}\n')
                writer.write(json.dumps(answers.get(name, {"return": {}})).encode() + b"\n")
            await writer.drain()

    return await asyncio.start_unix_server(client, str(path))


@pytest.mark.asyncio
async def test_cmds_are_written_at_once_and_answered_in_order(tmp_path: Path) -> None:
    sock = tmp_path / "qmp.sock"
    seen: list[list[str]] = []
    answers = {"query-status": {"return": {"status": "inmigrate"}}}
    srv = await _server(sock, answers, seen)
    qmp = await Qmp.connect(sock, 5)
    try:
        got = await qmp.cmds(
            ("migrate-set-capabilities", {"capabilities": []}),
            ("migrate-incoming", {"uri": "fd:7"}),
            ("query-status", None),
        )
        assert got == [{}, {}, {"status": "inmigrate"}]
        assert ["migrate-set-capabilities", "migrate-incoming", "query-status"] in seen
        assert [e["event"] for e in qmp.events] == ["MIGRATION"]
    finally:
        qmp.close()
        srv.close()


@pytest.mark.asyncio
async def test_cmds_raise_the_first_error_by_command(tmp_path: Path) -> None:
    sock = tmp_path / "qmp.sock"
    answers = {"migrate-incoming": {"error": {"class": "GenericError", "desc": "bad uri"}}}
    srv = await _server(sock, answers, [])
    qmp = await Qmp.connect(sock, 5)
    try:
        with pytest.raises(QmpError, match="QMP migrate-incoming: GenericError: bad uri"):
            await qmp.cmds(("migrate-set-capabilities", None), ("migrate-incoming", None))
        # the connection stays usable: every reply of the batch was read
        assert await qmp.cmd("query-status") == {}
    finally:
        qmp.close()
        srv.close()
