"""Guest programs compiled once per process (VM image imports reuse them), again on change."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dsec.edge.backends.microvm import disks

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (dsec setup)")


def test_compiled_once_per_source_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    real = disks._run

    def counting(argv: list[str]) -> None:
        calls.append(argv)
        real(argv)

    monkeypatch.setattr(disks, "_run", counting)
    disks._compiled.cache_clear()
    src = tmp_path / "p.c"
    src.write_text('#include <stdio.h>\nint main(void) { puts("one"); return 0; }\n')
    first = disks.static_program([src])
    assert disks.static_program([src]) == first
    assert len(calls) == 1
    disks.static_program([src], "-DX")  # other flags: another program
    assert len(calls) == 2
    src.write_text('#include <stdio.h>\nint main(void) { puts("two"); return 0; }\n')
    prog = tmp_path / "prog"
    prog.write_bytes(disks.static_program([src]))  # changed source: compiled again
    prog.chmod(0o755)
    assert len(calls) == 3
    assert subprocess.run([str(prog)], capture_output=True, text=True).stdout == "two\n"


def test_vmport_written_runnable(tmp_path: Path) -> None:
    out = disks.build_vmport(tmp_path / "bin" / "dsec-vmport")
    assert out.stat().st_mode & 0o111
    assert out.read_bytes()[:4] == b"\x7fELF"
