"""Latency of the container backend next to bare crun (root only; prints a table with -s).

create  = image resolve + dirs + overlay mount + socket + config.json + crun run -d
bare    = only ``crun run -d`` of an already mounted rootfs with the same config
The bounds asserted are loose (a shared 2-core machine); the printed medians are the point.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from collections.abc import Iterator

import pytest

from dsec.core.spec import SandboxSpec
from dsec.edge.backends.container import mntns, ocispec, overlay, testkit
from dsec.edge.backends.container.backend import ContainerBackend
from dsec.edge.backends.container.testkit import ContainerTestEnv

pytestmark = pytest.mark.root
N = 20
SPEC = SandboxSpec(memory_mb=256, pids=128, cpu=1.0)


@pytest.fixture(scope="module")
def cenv() -> Iterator[ContainerTestEnv]:
    reason = testkit.skip_reason()
    if reason:
        pytest.skip(reason)
    with testkit.container_test_env() as env:
        yield env


def _ms(samples: list[float]) -> str:
    s = sorted(samples)
    med = statistics.median(s) * 1e3
    return f"median {med:6.1f} ms  (min {s[0] * 1e3:.1f}, max {s[-1] * 1e3:.1f})"


def _timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


async def _bare_run(
    cenv: ContainerTestEnv, backend: ContainerBackend, launcher: mntns.Launcher
) -> float:
    """Time only ``crun run -d`` of a pre-mounted rootfs with a pre-written config."""
    image = cenv.store.resolve("base")
    sid, paths = cenv.sandbox()
    dirs = overlay.RootfsDirs.in_state_dir(paths.state_dir)
    paths.state_dir.mkdir(parents=True)
    dirs.make()
    overlay.mount_rootfs(dirs, image.layer_dirs)
    try:
        config = ocispec.build_config(
            sandbox_id=sid,
            spec=SPEC,
            image=image,
            rootfs=dirs.rootfs,
            agent_bundle=cenv.paths.agent_bundle,
            cgroups_path=backend.cgroup_path(sid),
        )
        ocispec.write_config(paths.state_dir, config)
        argv = [*launcher.prefix, "crun", f"--root={backend.crun.root}", "run", "-d"]
        argv += [f"--bundle={paths.state_dir}", sid]
        return await asyncio.to_thread(_timed, argv)
    finally:
        await backend.destroy(sid, paths)
        assert backend.leaked(sid, paths) == []


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_create_destroy_latency_vs_bare_crun(cenv: ContainerTestEnv) -> None:
    backend = cenv.backend()
    sid, paths = cenv.sandbox()
    await backend.create(sid, SPEC, paths)  # warm-up: creates crun's namespace
    await backend.destroy(sid, paths)
    launchers = [backend._launcher(cenv.paths.home / "edge" / "sandboxes" / "x" / "rootfs")]
    if launchers[0].how == "nsenter":
        launchers.append(mntns.PER_CALL)
    creates: list[float] = []
    destroys: list[float] = []
    bare: dict[str, list[float]] = {la.how: [] for la in launchers}
    plain: list[float] = []
    nsenter_cost: list[float] = []
    # Interleaved, so load from other jobs on the machine hits every variant alike.
    for _ in range(N):
        sid, paths = cenv.sandbox()
        t0 = time.perf_counter()
        await backend.create(sid, SPEC, paths)
        creates.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await backend.destroy(sid, paths)
        destroys.append(time.perf_counter() - t0)
        assert backend.leaked(sid, paths) == []
        for la in launchers:
            bare[la.how].append(await _bare_run(cenv, backend, la))
        if backend._ns is not None:
            plain.append(_timed(["true"]))
            nsenter_cost.append(_timed([*backend._ns.launcher.prefix, "true"]))

    print()
    print(f"container create (mount+config+crun run -d), n={N}: {_ms(creates)}")
    print(f"container destroy (delete -f+cgroups+umount+rm), n={N}: {_ms(destroys)}")
    for how, samples in bare.items():
        print(f"bare crun run -d via {how}, n={N}: {_ms(samples)}")
    if nsenter_cost:
        print(f"exec of `true`, n={N}: {_ms(plain)}")
        print(f"exec of `nsenter --mount=<ns> true`, n={N}: {_ms(nsenter_cost)}")
    assert statistics.median(creates) < 1.0
    assert statistics.median(destroys) < 1.0
