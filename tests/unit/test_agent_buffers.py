"""chronus's output ring and the shell marker parser."""

from __future__ import annotations

import pytest

from dsec.agent import procs, shells
from dsec.agent.protocol import KIND_ERR, KIND_OUT


def test_output_keeps_order_across_streams():
    out = procs.Output()
    out.add(KIND_OUT, b"a")
    out.add(KIND_ERR, b"b")
    out.add(KIND_OUT, b"c")
    assert out.since(0) == [(1, KIND_OUT, b"a"), (2, KIND_ERR, b"b"), (3, KIND_OUT, b"c")]
    assert out.since(2) == [(3, KIND_OUT, b"c")]
    assert out.since(3) == []


def test_output_ring_bounds_each_stream():
    out = procs.Output()
    chunk = b"x" * 65536
    for _ in range(40):  # 2.5 MiB of stdout
        out.add(KIND_OUT, chunk)
    out.add(KIND_ERR, b"small")
    kept = sum(len(d) for _, k, d in out.since(0) if k == KIND_OUT)
    assert procs.RING - len(chunk) < kept <= procs.RING
    assert [d for _, k, d in out.since(0) if k == KIND_ERR] == [b"small"]
    huge = procs.Output()
    huge.add(KIND_OUT, b"y" * (procs.RING + 5))
    assert len(huge.since(0)[0][2]) == procs.RING


def _run(nonce: str = "n0nce") -> shells._Run:
    return shells._Run(nonce)


def _out(run: shells._Run, kind: int) -> bytes:
    return b"".join(d for k, d in run.ready if k == kind)


def test_marker_ends_output_byte_exact():
    run = _run()
    run.feed(KIND_OUT, b"no newline at end__dsec_n0nce_7__\n")
    run.feed(KIND_ERR, b"__dsec_n0nce_7__\n")
    assert run.complete()
    assert run.code == 7
    assert _out(run, KIND_OUT) == b"no newline at end"
    assert _out(run, KIND_ERR) == b""


@pytest.mark.parametrize("cut", [1, 5, 12, 15, 18, 20])
def test_marker_split_across_reads(cut: int):
    data = b"hello\n__dsec_n0nce_0__\ntrailing from a background job"
    run = _run()
    run.feed(KIND_OUT, data[:cut])
    run.feed(KIND_OUT, data[cut:])
    run.feed(KIND_ERR, b"__dsec_n0nce_0__\n")
    assert run.complete()
    assert run.code == 0
    assert _out(run, KIND_OUT) == b"hello\n"


def test_similar_text_is_not_a_marker():
    run = _run()
    run.feed(KIND_OUT, b"__dsec_other_1__\n__dsec_n0nc")
    run.feed(KIND_OUT, b"e_ but not quite")
    assert not run.complete()
    run.flush()
    assert _out(run, KIND_OUT) == b"__dsec_other_1__\n__dsec_n0nce_ but not quite"


def test_quote_round_trips_through_a_shell():
    import subprocess

    text = 'it\'s "quoted" $HOME `x` \\ \n new line'
    out = subprocess.run(["/bin/sh", "-c", "printf %s " + shells.quote(text)], capture_output=True)
    assert out.stdout.decode() == text
