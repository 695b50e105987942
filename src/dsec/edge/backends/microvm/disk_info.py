"""``qemu-img info`` of a disk image, read one way for every caller: its format, virtual
size and backing file. Callers choose the error a disk that cannot be read raises (a
snapshot disk is corrupt; an imported file is not a disk image)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dsec.core.errors import DsecError


@dataclass(frozen=True, slots=True)
class DiskInfo:
    format: str
    virtual_size: int
    backing: str  # the backing file it names ("" when it has none)


def disk_info(path: Path, error: type[DsecError], what: str, *, shared: bool = False) -> DiskInfo:
    """What ``qemu-img info`` says of ``path`` (``shared``: also while a VMM has it open).

    Raises:
        error: ``qemu-img`` cannot read it, as ``"<what>: <qemu-img's reason>"``.
    """
    argv = ["qemu-img", "info", "--output=json", *(["-U"] if shared else []), str(path)]
    r = subprocess.run(argv, capture_output=True, text=True)
    try:
        info = json.loads(r.stdout) if r.returncode == 0 else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise error(f"{what}: {(r.stderr or r.stdout).strip()[-500:]}")
    backing = info.get("full-backing-filename") or info.get("backing-filename") or ""
    return DiskInfo(str(info.get("format", "")), int(info.get("virtual-size", 0)), str(backing))
