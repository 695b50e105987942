"""Helpers for tests that run real containers before the real agent bundle exists.

A fake agent bundle is a directory whose ``init`` is a shell script that sleeps, so a
container stays up and can be inspected with ``crun exec``.
"""

from __future__ import annotations

import os
from pathlib import Path

FAKE_INIT = "#!/bin/sh\nexec sleep 100000\n"


def make_fake_agent_bundle(path: Path, init_script: str = FAKE_INIT) -> Path:
    """Create (or overwrite) a bundle at ``path`` with a shell ``init``; return ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "run").mkdir(exist_ok=True)
    init = path / "init"
    init.write_text(init_script)
    os.chmod(init, 0o755)
    return path
