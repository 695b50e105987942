"""The recording overhead of ``exec`` (``bench.trajectory``'s: an unbound and a recorded
sandbox called in turn, ``--trajectory-sync FULL``) for the ``dsec`` on ``sys.path``, this
tree's or another checkout's (the platform's daemons inherit ``PYTHONPATH``), for a
side-by-side comparison of two versions under the same load; alternate them:

    for i in 1 2; do
      PYTHONPATH=/work/main/src .venv/bin/python -m bench.trajectory_ab main
      PYTHONPATH=src .venv/bin/python -m bench.trajectory_ab branch
    done

``log`` as the third argument measures the log alone instead (``bench.trajectory``'s
``log_costs``, no platform: the append per step, ``FULL`` and ``NORMAL``, and the disk's
flush floor; CALLS steps), which varies less under load than a round trip.

Prints one JSON line per run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import dsec
from bench.foundation import settle
from bench.trajectory import log_costs, overhead
from dsec.sdk import Client
from dsec.testing.platform import running_platform


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    os.environ["DSEC_TRAJECTORY_SYNC"] = "FULL"
    out: dict[str, Any] = {
        "code": label,
        "dsec": os.path.dirname(dsec.__file__),
        "load": os.getloadavg(),
    }
    if sys.argv[3:4] == ["log"]:
        for sync in ("FULL", "NORMAL"):
            out[f"log_alone_{sync.lower()}"] = log_costs(sync, calls, 8)
        out["load_at_end"] = os.getloadavg()
        print(json.dumps(out))
        return
    with running_platform() as p:
        client = Client(api_url=p.api_url, api_key=p.admin_key)
        settle(3)
        try:
            out["recording_overhead"] = overhead(client, calls)
        finally:
            client.close()
    out["load_at_end"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
