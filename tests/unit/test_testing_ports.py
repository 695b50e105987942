from __future__ import annotations

import socket
from pathlib import Path

from dsec.testing import ports


def test_blocks_start_outside_the_ephemeral_range_and_fit_below_it() -> None:
    spans = ports.candidate_bases(8, (32768, 60999))
    assert spans == [range(ports.LOWEST, 32761), range(61000, 65529)]
    for r in spans:  # the whole block of 8 stays outside
        assert r[-1] + 7 < 32768 or r[0] > 60999
    assert ports.candidate_bases(8, (ports.LOWEST, 65535)) == []


def test_the_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_a_found_block_is_free_and_not_ephemeral() -> None:
    lo, hi = ports.ephemeral_range()
    base = ports.free_port_base(5)
    assert base + 4 < lo or base > hi
    held = [socket.socket() for _ in range(5)]
    try:
        for i, s in enumerate(held):
            s.bind(("127.0.0.1", base + i))  # all five really were free
    finally:
        for s in held:
            s.close()


def test_a_taken_port_is_not_free() -> None:
    with socket.socket() as s:
        port = ports.free_port()
        s.bind(("127.0.0.1", port))
        s.listen()
        assert not ports._all_free(port, 1)
