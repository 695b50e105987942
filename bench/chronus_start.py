"""How long after aether starts chronus (the process keeper) listens.

aether forks chronus as it starts, so a sandbox's first ``process.*`` call (every E2B
``commands.run``) waits only for what is left of that. This starts aether from the agent
bundle on the host (``dsec.agent.local.LocalAgent``, with the eager start the sandboxes
get) and times its start to chronus accepting on its socket.

    .venv/bin/python -m bench.chronus_start [--bundle DIR] [-n N]

Prints JSON (medians; the load average, which dominates on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from bench.foundation import summary
from dsec.agent.local import LocalAgent
from dsec.paths import Paths


def once(bundle: Path) -> float:
    with tempfile.TemporaryDirectory() as d:
        agent = LocalAgent(Path(d), bundle)
        env = agent.env()
        env.pop("DSEC_AGENT_LAZY_CHRONUS", None)  # as in a sandbox: started with aether
        agent.env = lambda: env  # type: ignore[method-assign]
        t0 = time.perf_counter()
        agent.start()
        try:
            path = str(agent.run_dir / "chronus.sock")
            while True:
                with socket.socket(socket.AF_UNIX) as s:
                    try:
                        s.connect(path)
                        break
                    except OSError:
                        pass
                if time.perf_counter() - t0 > 30:
                    raise RuntimeError("chronus did not start within 30 s")
                time.sleep(0.002)
            return time.perf_counter() - t0
        finally:
            agent.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, default=None, help="default: $DSEC_DATA/agent")
    ap.add_argument("-n", type=int, default=7)
    args = ap.parse_args()
    bundle = args.bundle or Paths.from_env(None).agent_bundle
    load = os.getloadavg()[0]
    res = {"aether_start_to_chronus_listening": summary([once(bundle) for _ in range(args.n)])}
    print(json.dumps({**res, "loadavg": [round(load, 1), round(os.getloadavg()[0], 1)]}))


if __name__ == "__main__":
    main()
