"""``dsec image build`` benchmark: a 4-step Dockerfile from ``base`` (2 RUN, 2 COPY of a
10 MiB context) built cold, rebuilt fully cached, and rebuilt after one COPY source changed,
through the SDK against a running platform (its own data dir; base linked in).

    .venv/bin/python -m bench.image_build [--runs 3]

Prints a Markdown table and writes ``bench/results/image_build.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.paths import Paths
from dsec.sdk import Client
from dsec.testing.image_data import private_data
from dsec.testing.platform import running_platform

DOCKERFILE = """\
FROM base
RUN useradd -m app && echo one > /one.txt
COPY data/ /srv/data/
COPY note.txt /srv/
RUN cat /srv/note.txt > /srv/copy.txt
"""


def _context(top: Path) -> Path:
    ctx = top / "ctx"
    (ctx / "data").mkdir(parents=True)
    for i in range(10):
        (ctx / "data" / f"blob{i}").write_bytes(os.urandom(1 << 20))
    (ctx / "note.txt").write_text("v0\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    return ctx


def _timed(client: Client, ctx: Path, tag: str, **kw: Any) -> tuple[float, int]:
    cached = 0

    def progress(ev: dict[str, Any]) -> None:
        nonlocal cached
        cached += 1 if ev.get("cached") else 0

    t = time.perf_counter()
    client.build_image(ctx, tag, progress=progress, **kw)
    return time.perf_counter() - t, cached


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    shared = Paths.from_env().data
    top = Path(tempfile.mkdtemp(prefix="dsec-bench-build-"))
    os.environ["DSEC_DATA"] = str(private_data(shared, top))
    rows: dict[str, list[float]] = {"cold (--no-cache)": [], "all cached": [], "COPY changed": []}
    try:
        ctx = _context(top)
        with running_platform() as p, Client(api_url=p.api_url, api_key=p.admin_key) as c:
            for run in range(args.runs):
                rows["cold (--no-cache)"].append(_timed(c, ctx, "b/x:1", no_cache=True)[0])
                took, cached = _timed(c, ctx, "b/x:1")
                assert cached == 4, cached
                rows["all cached"].append(took)
                (ctx / "note.txt").write_text(f"v{run + 1}\n")
                took, cached = _timed(c, ctx, "b/x:1")
                assert cached == 2, cached
                rows["COPY changed"].append(took)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    out = {k: {"median_s": statistics.median(v), "runs": v} for k, v in rows.items()}
    print("| build (4 layer steps: RUN, COPY 10 MiB, COPY, RUN) | median s |")
    print("|---|---|")
    for k, v in out.items():
        print(f"| {k} | {v['median_s']:.2f} |")
    path = Path(__file__).parent / "results" / "image_build.json"
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
