"""What a sandbox left behind on the host, checked from the test process (read-only)."""

from __future__ import annotations

from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container.backend import ContainerBackend
from dsec.edge.backends.container.mntns import CrunNamespace
from dsec.edge.images.store import ImageStore
from dsec.testing.platform import RunningPlatform


def leaks(platform: RunningPlatform, sandbox_id: str) -> list[str]:
    paths = platform.paths
    backend = ContainerBackend(paths, "test", image_store=ImageStore(paths.images))
    ns_file = paths.run / "crun.mntns"
    if ns_file.exists():
        backend._ns = CrunNamespace(ns_file, paths.home / "edge" / "sandboxes")
    sp = SandboxPaths(
        state_dir=paths.home / "edge" / "sandboxes" / sandbox_id,
        agent_socket=paths.run / "sbx" / f"{sandbox_id}.sock",
    )
    return backend.leaked(sandbox_id, sp)
