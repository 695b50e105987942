"""Foundation benchmark: create latency, exec round trip, burst creates and idle memory.

Runs the real platform (iam, watcher, edge, apiserver) in a temp home, and next to it, in
the same run, the floor: a bare ``crun run`` of ``/bin/true`` in the same image rootfs with
the same limits, mounts and seccomp profile.

    .venv/bin/python -m bench.foundation [--quick]

Prints a Markdown table and writes ``bench/results/foundation.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform as host_platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.core.ids import new_sandbox_id
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.container import ocispec, overlay
from dsec.edge.backends.container.backend import ContainerBackend
from dsec.edge.images.store import ImageStore
from dsec.paths import Paths
from dsec.sdk import AsyncSandbox, Client, Sandbox
from dsec.testing.platform import RunningPlatform, running_platform

SPEC = SandboxSpec(cpu=1.0, memory_mb=256, pids=128)


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in samples_s)
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2),
        "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2),
        "min_ms": round(ms[0], 2),
        "max_ms": round(ms[-1], 2),
    }


async def crun_floor(n: int) -> list[float]:
    """Bare `crun run /bin/true` of the same rootfs with the same config and limits."""
    top = Path(tempfile.mkdtemp(prefix="dsecb-", dir="/tmp"))
    paths = Paths(home=top / "home", data=Paths.from_env().data, run=top / "run")
    backend = ContainerBackend(
        paths, "bnch", image_store=ImageStore(paths.images), cgroup_parent="dsec-bench"
    )
    await backend._setup()
    image = backend.images.resolve("base")
    out: list[float] = []
    try:
        for _ in range(n):
            sid = new_sandbox_id("bnch", os.urandom(13))
            state = backend.sandboxes_dir / sid
            state.mkdir(parents=True)
            dirs = overlay.RootfsDirs.in_state_dir(state)
            dirs.make()
            overlay.mount_rootfs(dirs, image.layer_dirs)
            try:
                cfg = ocispec.build_config(
                    sandbox_id=sid,
                    spec=SPEC,
                    image=image,
                    rootfs=dirs.rootfs,
                    agent_bundle=paths.agent_bundle,
                    cgroups_path=backend.cgroup_path(sid),
                )
                cfg["process"]["args"] = ["/bin/true"]
                ocispec.write_config(state, cfg)
                argv = [
                    *backend._launcher(dirs.rootfs).prefix,
                    "crun",
                    f"--root={backend.crun.root}",
                    "run",
                    f"--bundle={state}",
                    sid,
                ]
                t0 = time.perf_counter()
                subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True
                )
                out.append(time.perf_counter() - t0)
            finally:
                from dsec.edge.backends.api import SandboxPaths

                await backend.destroy(sid, SandboxPaths(state, paths.run / f"{sid}.sock"))
    finally:
        backend.release_host_setup()
        shutil.rmtree(top, ignore_errors=True)
    return out


def settle(seconds: float = 5.0) -> None:
    time.sleep(seconds)


def create_to_first_exec(n: int) -> list[float]:
    out = []
    client = Client()
    for _ in range(n):
        t0 = time.perf_counter()
        sbx = Sandbox.create(
            cpu=SPEC.cpu, memory_mb=SPEC.memory_mb, pids=SPEC.pids, timeout=120, client=client
        )
        r = sbx.exec("true")
        out.append(time.perf_counter() - t0)
        assert r.exit_code == 0
        sbx.kill()
        settle(0.5)
    client.close()
    return out


def exec_round_trip(n: int) -> list[float]:
    client = Client()
    sbx = Sandbox.create(memory_mb=256, timeout=600, client=client)
    try:
        for _ in range(20):
            sbx.exec("true")
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            sbx.exec("true")
            out.append(time.perf_counter() - t0)
        return out
    finally:
        sbx.kill()
        client.close()


async def burst(n: int) -> dict[str, Any]:
    t0 = time.perf_counter()

    async def one() -> AsyncSandbox | BaseException:
        try:
            return await AsyncSandbox.create(memory_mb=64, pids=64, cpu=0.1, timeout=600)
        except BaseException as exc:  # counted as a failure
            return exc

    results = await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, AsyncSandbox)]
    errors = [repr(r) for r in results if not isinstance(r, AsyncSandbox)]
    t1 = time.perf_counter()
    await asyncio.gather(*(s.kill() for s in ok), return_exceptions=True)
    teardown = time.perf_counter() - t1
    for s in ok:
        await s.aclose()
    return {
        "n": n,
        "ok": len(ok),
        "failures": len(errors),
        "errors": errors[:5],
        "wall_s": round(wall, 2),
        "rate_per_s": round(len(ok) / wall, 1),
        "teardown_s": round(teardown, 2),
    }


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def idle_memory(plat: RunningPlatform, n: int, with_shell: bool) -> dict[str, Any]:
    client = Client()
    sbxs = [Sandbox.create(memory_mb=64, cpu=0.25, timeout=600, client=client) for _ in range(n)]
    try:
        for s in sbxs:
            s.exec("true")
            if with_shell:
                s.shell("main").run("cd /tmp")
        time.sleep(2)
        per = []
        procs = []
        for s in sbxs:
            pids = plat.sandbox_pids(s.id)
            procs.append(len(pids))
            per.append(sum(_pss_kib(p) for p in pids) / 1024)
        return {
            "sandboxes": n,
            "with_shell_session": with_shell,
            "pss_mib_p50": round(statistics.median(per), 2),
            "pss_mib_min": round(min(per), 2),
            "pss_mib_max": round(max(per), 2),
            "processes_per_sandbox": statistics.median(procs),
        }
    finally:
        for s in sbxs:
            s.kill()
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller samples (smoke run)")
    args = ap.parse_args()
    n = 5 if args.quick else 20
    res: dict[str, Any] = {
        "host": {
            "cpus": os.cpu_count(),
            "kernel": host_platform.release(),
            "python": host_platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d"),
    }
    res["crun_floor"] = summary(asyncio.run(crun_floor(n)))
    plat: RunningPlatform
    with running_platform() as plat:
        os.environ.update(DSEC_API_URL=plat.api_url, DSEC_API_KEY=plat.admin_key)
        # Each phase starts on a settled machine: the kernel tears namespaces and cgroups
        # of killed sandboxes down in the background for a few seconds.
        res["exec_true_round_trip"] = summary(exec_round_trip(50 if args.quick else 300))
        settle()
        res["create_to_first_exec"] = summary(create_to_first_exec(n))
        settle()
        res["burst_creates"] = asyncio.run(burst(20 if args.quick else 200))
        settle()
        res["idle_memory"] = idle_memory(plat, 5 if args.quick else 50, with_shell=False)
        settle()
        res["idle_memory_with_shell"] = idle_memory(plat, 5 if args.quick else 20, with_shell=True)
    ratio = res["create_to_first_exec"]["p50_ms"] / res["crun_floor"]["p50_ms"]
    res["create_vs_floor_ratio"] = round(ratio, 2)
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    out = Path(__file__).with_name("results") / (
        "foundation-quick.json" if args.quick else "foundation.json"
    )
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
