"""The guest kernel build scripts/test runs in the background, and waiting for it.

scripts/install (with ``DSEC_KERNEL_BUILD=DIR``) starts
``python3 -m dsec.edge.backends.microvm.kernel`` in its own process group, writing its
output to ``DIR/log``, its pid to ``DIR/pid`` and, when it ends, its exit status to
``DIR/rc``. scripts/test waits here (``python -m dsec.testing.kernel_build``) between its
pytest pass without the tests marked ``guest_kernel`` and the pass with only them; a
failed build fails the run with the end of its log.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV = "DSEC_KERNEL_BUILD"


@dataclass(frozen=True)
class KernelBuild:
    dir: Path

    @property
    def log(self) -> Path:
        return self.dir / "log"

    def status(self) -> str | None:
        """The exit status the build wrote, or None while it runs."""
        try:
            return (self.dir / "rc").read_text().strip()
        except FileNotFoundError:
            return None

    def running(self) -> bool:
        try:
            pid = int((self.dir / "pid").read_text())
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, ValueError, IndexError):
            return False

    def last_line(self) -> str:
        lines = self.tail(1)
        return lines[0] if lines else "starting"

    def tail(self, n: int) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [ln.strip() for ln in text.splitlines() if ln.strip()][-n:]

    def wait(self, progress: Callable[[str], None], every_s: float = 30.0) -> str | None:
        """Block until the build ends; None if it succeeded, else why not (with its log's end)."""
        t0 = last = time.monotonic()
        while (code := self.status()) is None:
            if not self.running() and self.status() is None:
                return self._failed("it stopped without an exit status")
            now = time.monotonic()
            if now - last >= every_s:
                last = now
                progress(
                    f"waiting for the guest kernel build ({now - t0:.0f} s): {self.last_line()}"
                )
            time.sleep(1)
        if code == "0":
            return None
        return self._failed(f"exit status {code}")

    def _failed(self, how: str) -> str:
        tail = "\n".join(self.tail(30))
        return f"the guest kernel build failed ({how}); the end of {self.log}:\n{tail}"


def from_env() -> KernelBuild | None:
    """The background build scripts/test started, or None when there is none."""
    d = os.environ.get(ENV)
    return KernelBuild(Path(d)) if d else None


def main() -> int:
    build = from_env()
    if build is None:
        return 0
    if build.status() is None:
        print(f"==> waiting for the guest kernel build: {build.last_line()}", file=sys.stderr)
    why = build.wait(lambda msg: print(msg, file=sys.stderr, flush=True))
    if why:
        print(why, file=sys.stderr)
        return 1
    print(f"==> guest kernel: {build.last_line()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
