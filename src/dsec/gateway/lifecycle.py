"""E2B's sandbox lifecycle: auto-pause at the timeout, auto-resume on traffic.

``Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": True})`` sends
``autoPause`` (and ``autoResume: {"enabled": true}``). Auto-pause is OpenDsec's own
``on_timeout="pause"`` (the edge pauses the sandbox when its timeout passes, keeps it paused,
and a resume starts a new timeout); backends that cannot pause refuse it with a 400.
Auto-resume is the gateway's: the flag is kept in the sandbox's metadata (the gateway has no
records), and a sandbox call that finds the sandbox paused resumes it and is served, as
E2B's proxy does. ``connect()`` resumes a paused sandbox either way.
"""

from __future__ import annotations

from typing import Any

from dsec.core.errors import DsecError, InvalidArgument
from dsec.sdk import wire
from dsec.sdk.async_sandbox import AsyncClient
from dsec.sdk.models import SandboxInfo

AUTO_RESUME_KEY = "e2b.auto_resume"  # sandbox metadata: "true" when auto-resume is on


def create_options(body: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """``(on_timeout, extra metadata)`` of an E2B create body (``None``: the default)."""
    pause = body.get("autoPause")
    if pause is not None and not isinstance(pause, bool):
        raise InvalidArgument("'autoPause' must be a boolean")
    if pause and body.get("autoPauseMemory") is False:
        raise InvalidArgument(
            "auto-pause mode 'filesystem' is not supported by OpenDsec: a paused sandbox "
            "keeps its memory (leave the mode unset or use 'full')"
        )
    resume = body.get("autoResume")
    enabled = isinstance(resume, dict) and resume.get("enabled") is True
    if enabled and not pause:
        raise InvalidArgument("autoResume needs autoPause (lifecycle on_timeout='pause')")
    return ("pause" if pause else None), ({AUTO_RESUME_KEY: "true"} if enabled else {})


def auto_resumes(info: SandboxInfo) -> bool:
    return bool(info.spec and info.spec.metadata.get(AUTO_RESUME_KEY) == "true")


def lifecycle_json(info: SandboxInfo) -> dict[str, Any]:
    """``SandboxDetail.lifecycle``."""
    on_timeout = info.spec.on_timeout if info.spec else "kill"
    return {"autoResume": auto_resumes(info), "onTimeout": on_timeout}


def visible_metadata(info: SandboxInfo) -> dict[str, str]:
    """The metadata E2B shows: the user's, without the gateway's own flag."""
    meta = dict(info.spec.metadata) if info.spec else {}
    meta.pop(AUTO_RESUME_KEY, None)
    return meta


async def resume_if_paused(client: AsyncClient, sandbox_id: str) -> bool:
    """Resume the sandbox if it is paused and auto-resumes; whether it was resumed."""
    try:
        info = await client.get_sandbox(sandbox_id)
        if info.state != "paused" or not auto_resumes(info):
            return False
        await client.transport.call(wire.resume_sandbox(sandbox_id))
    except DsecError:
        return False
    return True
