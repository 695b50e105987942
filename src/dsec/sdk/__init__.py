"""The OpenDsec Python SDK: create sandboxes and run commands, files, processes, PTYs in them.

Blocking::

    from dsec.sdk import Sandbox

    with Sandbox.create(image="base") as sbx:
        print(sbx.exec("echo hi").stdout)

asyncio (same names, awaited)::

    from dsec.sdk import AsyncSandbox

    async with await AsyncSandbox.create() as sbx:
        print((await sbx.exec("echo hi")).stdout)

The API URL and key come from the arguments, else ``DSEC_API_URL``/``DSEC_API_KEY``, else
the client file ``dsec up`` writes (see :mod:`dsec.sdk.config`).
"""

from dsec.sdk.async_sandbox import AsyncClient, AsyncSandbox
from dsec.sdk.async_sandbox_runtime import (
    AsyncFiles,
    AsyncProcesses,
    AsyncPty,
    AsyncPtys,
    AsyncShell,
)
from dsec.sdk.config import ClientConfig, resolve_config
from dsec.sdk.errors import CommandTimeout, MissingCredentials
from dsec.sdk.models import (
    BatchResult,
    ExecEvent,
    ExecResult,
    FileEntry,
    HttpResponse,
    Identity,
    KeyInfo,
    NewKey,
    ProcessInfo,
    SandboxInfo,
    ShellSession,
    SnapshotInfo,
    SpecInfo,
    WriteResult,
)
from dsec.sdk.sandbox import Client, Sandbox
from dsec.sdk.sandbox_runtime import Files, Processes, Pty, Ptys, Shell
from dsec.sdk.tcp import AsyncTcpStream, TcpStream

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcesses",
    "AsyncPty",
    "AsyncPtys",
    "AsyncSandbox",
    "AsyncShell",
    "AsyncTcpStream",
    "BatchResult",
    "Client",
    "ClientConfig",
    "CommandTimeout",
    "ExecEvent",
    "ExecResult",
    "FileEntry",
    "Files",
    "HttpResponse",
    "Identity",
    "KeyInfo",
    "MissingCredentials",
    "NewKey",
    "ProcessInfo",
    "Processes",
    "Pty",
    "Ptys",
    "Sandbox",
    "SandboxInfo",
    "Shell",
    "ShellSession",
    "SnapshotInfo",
    "SpecInfo",
    "TcpStream",
    "WriteResult",
    "resolve_config",
]
