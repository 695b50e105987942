"""Images benchmark: pull vs ``skopeo copy``, disk of N sandboxes of one image, pack time.

- pull: a 4-layer gzip image cut from the base image (about 230 MB uncompressed) is pushed
  to Debian's docker-registry on 127.0.0.1; then, in the same run and alternating, our
  download (verified blobs, no unpack), our full pull (download + confined unpack) and
  ``skopeo copy docker://... oci:DIR`` (download + verify, no unpack) into fresh dirs.
- sandboxes: N sandboxes of the base image created with the container backend (fake agent
  init); the blocks allocated under the node's dirs (state dirs with upper/work, not
  crossing into the mounted rootfs) plus the layer store, before and after.
- pack: 100 MiB of new files in a sandbox's overlay, packed into a layer (tar + gzip -1 +
  the confined unpack into the store).

    .venv/bin/python -m bench.images [--runs 3] [--sandboxes 100]

Prints a Markdown table and writes ``bench/results/images.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dsec.core.spec import SandboxSpec
from dsec.edge.backends.container import overlay, testkit
from dsec.edge.images.base import BASE_IMAGE
from dsec.edge.images.pack import pack_upper
from dsec.edge.images.pull import Puller, PullOptions
from dsec.edge.images.reference import parse_reference
from dsec.edge.images.registry import RegistryClient
from dsec.edge.images.store import ImageStore
from dsec.testing.registry import LocalRegistry, local_registry, push_image

GROUPS = (
    ["usr/lib"],
    ["usr/share"],
    ["usr/bin", "usr/sbin", "usr/libexec", "usr/include", "usr/local", "usr/games", "usr/src"],
    None,  # everything else
)


def layer_tars(layer: Path) -> list[bytes]:
    """The base layer cut into 4 tars (by directory)."""
    taken = [p for g in GROUPS if g for p in g]
    out = []
    for group in GROUPS:
        if group is None:
            cmd = ["tar", "-C", str(layer), "--numeric-owner", "-cf", "-"]
            cmd += [f"--exclude=./{p}" for p in taken] + ["."]
        else:
            present = [f"./{p}" for p in group if (layer / p).exists()]
            cmd = ["tar", "-C", str(layer), "--numeric-owner", "-cf", "-", *present]
        out.append(subprocess.run(cmd, capture_output=True, check=True).stdout)
    return out


def time_download(reg: LocalRegistry, name: str, dest: Path) -> float:
    ref = parse_reference(f"{reg.host}/{name}")
    start = time.perf_counter()
    with RegistryClient(ref, reg.settings, insecure=True) as client:
        manifest = client.get_manifest(ref.selector).json()
        layers = manifest["layers"]
        client.get_blob_bytes(manifest["config"]["digest"])
        with ThreadPoolExecutor(4) as pool:
            list(
                pool.map(
                    lambda d: client.download_blob(
                        d["digest"], dest / d["digest"][7:], size=d["size"]
                    ),
                    layers,
                )
            )
    return time.perf_counter() - start


def time_pull(reg: LocalRegistry, name: str, root: Path) -> float:
    start = time.perf_counter()
    Puller(ImageStore(root)).pull(f"{reg.host}/{name}", PullOptions(insecure=True))
    return time.perf_counter() - start


def time_skopeo(reg: LocalRegistry, name: str, dest: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--src-tls-verify=false",
            f"docker://{reg.host}/{name}",
            f"oci:{dest}:bench",
        ],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def time_gnu_tar(reg: LocalRegistry, digests: list[str], dest: Path) -> float:
    """The unpack floor: GNU ``tar -xzpf`` of the same blobs (no download, no checks)."""
    start = time.perf_counter()
    for d in digests:
        layer = dest / d[7:19]
        layer.mkdir()
        subprocess.run(
            ["tar", "-xzpf", str(reg.blob_file(d)), "-C", str(layer), "--numeric-owner"],
            check=True,
            capture_output=True,
        )
    return time.perf_counter() - start


def bench_pull(runs: int, base_layer: Path) -> dict[str, Any]:
    tars = layer_tars(base_layer)
    result: dict[str, Any] = {"layers_mb": [round(len(t) / 1e6, 1) for t in tars]}
    with local_registry() as reg:
        pushed = push_image(reg, "bench/layered:v1", tars)
        result["compressed_mb"] = round(
            sum(reg.blob_file(d).stat().st_size for d in pushed.layer_digests) / 1e6, 1
        )
        samples: dict[str, list[float]] = {"download": [], "pull": [], "skopeo": [], "tar": []}
        for _ in range(runs):
            for kind, fn in (
                ("skopeo", time_skopeo),
                ("download", time_download),
                ("pull", time_pull),
            ):
                d = Path(tempfile.mkdtemp(prefix="dsec-bench-"))
                try:
                    samples[kind].append(fn(reg, "bench/layered:v1", d))
                finally:
                    shutil.rmtree(d, ignore_errors=True)
            d = Path(tempfile.mkdtemp(prefix="dsec-bench-"))
            try:
                samples["tar"].append(time_gnu_tar(reg, list(pushed.layer_digests), d))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    result.update({f"{k}_s": round(statistics.median(v), 2) for k, v in samples.items()})
    result["samples"] = samples
    return result


def disk_used(path: Path) -> int:
    """Allocated bytes under ``path``, not crossing into other mounts (the rootfs overlay)."""
    total = 0
    dev = path.stat().st_dev
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_dev == dev]
        for n in (*dirnames, *filenames):
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


async def bench_sandboxes(n: int) -> dict[str, Any]:
    with testkit.container_test_env() as env:
        backend = env.backend()
        created = []
        layers = env.store.layers_dir
        before = disk_used(env.root) + disk_used(layers)
        start = time.perf_counter()
        try:
            for _ in range(n):
                sid, paths = env.sandbox()
                await backend.create(sid, SandboxSpec(memory_mb=64, pids=64), paths)
                created.append((sid, paths))
            elapsed = time.perf_counter() - start
            after = disk_used(env.root) + disk_used(layers)
        finally:
            for sid, paths in created:
                await backend.destroy(sid, paths)
    return {
        "sandboxes": n,
        "create_all_s": round(elapsed, 2),
        "disk_growth_mib": round((after - before) / (1 << 20), 2),
        "per_sandbox_kib": round((after - before) / n / 1024, 1),
    }


def bench_pack(store: ImageStore, mib: int = 100) -> dict[str, Any]:
    image = store.resolve(BASE_IMAGE)
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-pack-"))
    scratch = ImageStore(tmp / "images")
    dirs = overlay.RootfsDirs.in_state_dir(tmp / "sbx")
    dirs.make()
    overlay.mount_rootfs(dirs, image.layer_dirs)
    try:
        data = dirs.rootfs / "data"
        data.mkdir()
        for i in range(mib):
            (data / f"f{i}").write_bytes(os.urandom(1 << 20))
        os.sync()
        start = time.perf_counter()
        layer = pack_upper(scratch, dirs.upper)
        elapsed = time.perf_counter() - start
    finally:
        overlay.unmount_rootfs(dirs.rootfs)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"change_mib": mib, "pack_s": round(elapsed, 2), "layer_mb": round(layer.size / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sandboxes", type=int, default=100)
    args = ap.parse_args()
    store = testkit.installed_store()
    out = {
        "pull": bench_pull(args.runs, store.resolve(BASE_IMAGE).layer_dirs[-1]),
        "sandboxes": asyncio.run(bench_sandboxes(args.sandboxes)),
        "pack": bench_pack(store),
    }
    p, s, k = out["pull"], out["sandboxes"], out["pack"]
    print("| measure | median |")
    print("|---|---|")
    print(
        f"| pull, 4 layers {p['compressed_mb']} MB gz: skopeo copy (no unpack) "
        f"| {p['skopeo_s']} s |"
    )
    print(f"| same: our download, verified (no unpack) | {p['download_s']} s |")
    print(f"| same: our full pull (download + confined unpack) | {p['pull_s']} s |")
    print(f"| same blobs: GNU tar -xzpf only (unpack floor) | {p['tar_s']} s |")
    print(f"| {s['sandboxes']} sandboxes of one image: create all | {s['create_all_s']} s |")
    print(f"| same: disk growth | {s['disk_growth_mib']} MiB ({s['per_sandbox_kib']} KiB each) |")
    print(f"| pack a {k['change_mib']} MiB change | {k['pack_s']} s ({k['layer_mb']} MB gz) |")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "images.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
