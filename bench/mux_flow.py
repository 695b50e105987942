"""The microVM agent-channel multiplexer with and without per-channel flow control.

Host mux and guest mux (the real classes) over a socketpair, the guest's "aether" a unix
server (tests/unit/muxkit.py, what the mux tests use), no VM: it measures the multiplexer
alone, with the guest end every VM runs (``guest/vmport.c``, built with gcc).

* one stream: 32 MiB from the host through the guest and back (an echo), MB/s;
* a small call (20 KB echo) while another channel is stuck (its receiver stopped reading
  a 32 MiB upload): how long the small call takes, or that it never finished.

    .venv/bin/python -m bench.mux_flow [--runs 5]

Prints JSON and writes ``bench/results/mux_flow.json``. "off" is the protocol an older
guest speaks (no window in its READY): DATA is written through as it arrives.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.edge.backends.microvm import frames
from dsec.edge.backends.microvm.mux import HostMux
from tests.unit.muxkit import PairLink, build_c_guest, sink_and_flood_server

STREAM_MB = 32
STALL_LIMIT_S = 5.0


async def _stream(sock: Path, total: int) -> float:
    r, w = await asyncio.open_unix_connection(str(sock))
    chunk = b"z" * 65536
    start = time.perf_counter()

    async def send() -> None:
        for _ in range(total // len(chunk)):
            w.write(chunk)
            await w.drain()

    sender = asyncio.create_task(send())
    got = 0
    while got < total:
        got += len(await r.read(1 << 20))
    await sender
    w.close()
    return time.perf_counter() - start


async def _call_beside_a_stuck_stream(sock: Path) -> float | None:
    _r, stuck = await asyncio.open_unix_connection(str(sock))

    async def push() -> None:
        stuck.write(b"SINK ")
        for _ in range(STREAM_MB * 16):
            stuck.write(b"y" * 65536)
            await stuck.drain()

    pusher = asyncio.create_task(push())
    await asyncio.sleep(1.0)
    payload = os.urandom(10_000).hex().encode()
    start = time.perf_counter()
    try:
        r, w = await asyncio.open_unix_connection(str(sock))
        w.write(payload)
        await asyncio.wait_for(r.readexactly(len(payload)), STALL_LIMIT_S)
        w.close()
        took: float | None = time.perf_counter() - start
    except TimeoutError:
        took = None
    pusher.cancel()
    with contextlib.suppress(BaseException):
        await pusher
    stuck.close()
    return took


async def run_one(flow: bool, runs: int, c_guest: Path) -> dict[str, Any]:
    saved = frames.WINDOW
    if not flow:
        frames.WINDOW = 0  # the host offers no window: the old protocol
    d = Path(tempfile.mkdtemp(prefix="dsmb-", dir="/tmp"))
    srv = sink_and_flood_server(d / "aether.sock")
    link = PairLink(d / "aether.sock", c_guest)
    mux = HostMux(d / "agent.sock", link)
    try:
        await mux.start()
        await mux.wait_ready(5)
        total = STREAM_MB << 20
        secs = [await _stream(mux.listen_path, total) for _ in range(runs)]
        stalled = await _call_beside_a_stuck_stream(mux.listen_path)
    finally:
        await mux.close()
        link.close()
        srv.close()
        shutil.rmtree(d, ignore_errors=True)
        frames.WINDOW = saved
    return {
        "stream_MBps_median": round(STREAM_MB / statistics.median(secs), 1),
        "stream_MBps_all": [round(STREAM_MB / s, 1) for s in secs],
        "call_beside_stuck_stream_ms": None if stalled is None else round(stalled * 1000, 1),
        "call_beside_stuck_stream": "finished" if stalled is not None else
        f"did not finish within {STALL_LIMIT_S:g} s",
    }  # fmt: skip


async def main_async(runs: int) -> dict[str, Any]:
    out = {
        "runs": runs,
        "stream_MiB": STREAM_MB,
        "load_average": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="dsmb-c-") as tmp:
        c_guest = build_c_guest(Path(tmp))
        out["flow_control_on"] = await run_one(True, runs, c_guest)
        out["flow_control_off"] = await run_one(False, runs, c_guest)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    out = asyncio.run(main_async(args.runs))
    text = json.dumps(out, indent=1)
    print(text)
    res = Path(__file__).parent / "results"
    res.mkdir(exist_ok=True)
    (res / "mux_flow.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
