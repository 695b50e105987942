"""Where OpenDsec keeps things on a node.

``home`` holds durable state (PKI, IAM and edge databases, logs, client credentials).
``data`` holds shared, slow-to-build artefacts (images, the agent bundle) so test instances
can reuse what ``dsec setup`` built. ``run`` holds sockets and runtime state and must be a
short path (unix socket paths are limited to 108 bytes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = Path("/var/lib/dsec")
DEFAULT_DATA = Path("/var/lib/dsec")
DEFAULT_RUN = Path("/run/dsec")


@dataclass(frozen=True, slots=True)
class Paths:
    home: Path
    data: Path
    run: Path

    @classmethod
    def from_env(cls, home: str | Path | None = None) -> Paths:
        h = Path(home or os.environ.get("DSEC_HOME") or DEFAULT_HOME)
        data = Path(os.environ.get("DSEC_DATA") or DEFAULT_DATA)
        run = Path(os.environ.get("DSEC_RUN") or (DEFAULT_RUN if h == DEFAULT_HOME else h / "run"))
        return cls(home=h, data=data, run=run)

    @property
    def pki(self) -> Path:
        return self.home / "pki"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def images(self) -> Path:
        return self.data / "images"

    @property
    def agent_bundle(self) -> Path:
        return self.data / "agent"

    @property
    def client_config(self) -> Path:
        return self.home / "client.json"

    @property
    def supervisor_pid(self) -> Path:
        return self.run / "dsec-up.pid"
