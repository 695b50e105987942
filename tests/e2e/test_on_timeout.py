"""``on_timeout="pause"`` through our own SDK: paused (not ended) at the timeout, resumed."""

from __future__ import annotations

import time

import pytest

from dsec.core.errors import InvalidArgument
from dsec.sdk import Client, Sandbox


def test_on_timeout_pause_pauses_and_resume_gives_a_new_timeout(api: Client) -> None:
    s = Sandbox.create(memory_mb=256, timeout=10, on_timeout="pause", client=api)
    try:
        spec = s.info().spec
        assert spec is not None
        assert spec.on_timeout == "pause"
        s.exec("echo kept > /tmp/kept")
        deadline = time.monotonic() + 60
        while (info := s.info()).state != "paused":
            assert info.state == "running", info
            assert time.monotonic() < deadline, "not paused at its timeout"
            time.sleep(0.5)
        resumed = s.resume()
        assert resumed.state == "running"
        assert resumed.expires_at is not None
        assert resumed.expires_at.timestamp() > time.time() + 3
        assert s.exec("cat /tmp/kept").stdout == "kept\n"
    finally:
        s.kill()


def test_on_timeout_pause_needs_a_backend_that_pauses(api: Client) -> None:
    with pytest.raises(InvalidArgument, match="cannot pause"):
        Sandbox.create(backend="function", on_timeout="pause", client=api)
    with pytest.raises(InvalidArgument, match="on_timeout"):
        Sandbox.create(memory_mb=256, on_timeout="hibernate", client=api)
