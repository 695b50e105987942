"""bench.microvm_trace's log parsing and classification (no VM: a made-up log and maps)."""

from __future__ import annotations

from pathlib import Path

from bench.microvm_trace import Where, block_addresses, classify

LOG = """----------------
IN:
0xffffffff81000010:  90                       nop
0xffffffff81000011:  c3                       retq

----------------
IN: some_label
0x00007ffff7a00100:  c3                       retq

----------------
IN:
0x0000555555558000:  c3                       retq

----------------
IN:
0xffffffff81000200:  c3                       retq

----------------
IN:
0x0000000000001000:  c3                       retq
"""

MAPS = """== /proc/36
7ffff7a00000-7ffff7b00000 r-xp 00000000 fe:10 1   /.dsec/lib/libpython3.11.so.1.0
7ffff7b00000-7ffff7c00000 r--p 00100000 fe:10 1   /.dsec/lib/libpython3.11.so.1.0
== /proc/46
555555558000-55555556b000 r-xp 00004000 fe:20 2   /usr/bin/dash
7ffff7a00000-7ffff7a10000 r-xp 00000000 fe:20 3   /usr/lib/x86_64-linux-gnu/libc.so.6
"""

KSYMS = [(0xFFFFFFFF81000000, "start"), (0xFFFFFFFF81000100, "do_exec")]


def test_block_addresses_takes_each_blocks_first_address(tmp_path: Path) -> None:
    log = tmp_path / "tb.log"
    log.write_text(LOG)
    assert block_addresses(log) == [
        0xFFFFFFFF81000010, 0x7FFFF7A00100, 0x555555558000, 0xFFFFFFFF81000200, 0x1000,
    ]  # fmt: skip


def test_classify_names_kernel_functions_and_user_files() -> None:
    where = Where(KSYMS, MAPS)
    blocks = [0xFFFFFFFF81000010, 0x7FFFF7A00100, 0x555555558000, 0xFFFFFFFF81000200, 0x1000]
    out = classify(blocks, where, top=5)
    assert (out["blocks"], out["kernel"], out["user"]) == (5, 2, 3)
    assert out["kernel_top_functions"] == {"start": 1, "do_exec": 1}
    # two processes with code at one address count under both; no mapping: "?"
    assert out["user_by_file"] == {
        "/.dsec/lib/libpython3.11.so.1.0|/usr/lib/x86_64-linux-gnu/libc.so.6": 1,
        "/usr/bin/dash": 1,
        "?": 1,
    }
    # read-only (non-executable) mappings name nothing
    assert where.user_file(0x7FFFF7B00010) == "?"
