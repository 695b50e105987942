"""End-to-end fixtures: one real platform (iam, watcher, edge, apiserver) per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform, requirements_missing, running_platform

_MISSING = requirements_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


@pytest.fixture(scope="session")
def platform() -> Iterator[RunningPlatform]:
    if _MISSING is not None:
        pytest.skip(_MISSING)
    with running_platform() as p:
        yield p
    assert not p.cgroups_left, f"the platform's edge left its cgroups: {p.cgroups_left}"


@pytest.fixture
def api(platform: RunningPlatform, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    monkeypatch.setenv("DSEC_API_URL", platform.api_url)
    monkeypatch.setenv("DSEC_API_KEY", platform.admin_key)
    client = Client(api_url=platform.api_url, api_key=platform.admin_key)
    yield client
    client.close()


@pytest.fixture
def sbx(api: Client) -> Iterator[Sandbox]:
    s = Sandbox.create(memory_mb=256, timeout=300)
    yield s
    try:
        s.kill()
    finally:
        s.close()


def pids_alive(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie awaiting its reaper counts as dead)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive
