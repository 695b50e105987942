"""Placement: filter, score (reports plus this apiserver's recent placements), order."""

from __future__ import annotations

import time

import pytest

from dsec.apiserver.placement import Placement
from dsec.apiserver.upstream import EdgeEntry
from dsec.core import errors
from dsec.rpc._gen import dsec_pb2 as pb


def _edge(edge_id: str, used_mb: int, *, healthy: bool = True, backend: str = "container",
          seen: float = 0.0):  # fmt: skip
    status = pb.EdgeStatus(edge_id=edge_id, memory_total_mb=1000, memory_allocated_mb=used_mb,
                           backends=[backend])  # fmt: skip
    view = pb.EdgeView(status=status, healthy=healthy, last_seen=seen or time.time() - 1)
    return EdgeEntry(edge_id, f"127.0.0.1:{len(edge_id)}", healthy, view)


def test_spread_fills_the_emptiest_and_counts_placements_between_reports() -> None:
    p = Placement("spread")
    edges = [_edge("aaaa", 1000), _edge("bbbb", 0), _edge("cccc", 500)]
    assert [e.edge_id for e in p.order(edges, "container", 100)] == ["bbbb", "cccc", "aaaa"]
    for _ in range(6):  # 6 x 100 MiB on bbbb since its last report
        p.placed("bbbb", 100)
    assert p.order(edges, "container", 100)[0].edge_id == "cccc"
    chosen = []
    for _ in range(30):  # a burst spreads over every edge
        first = p.order(edges, "container", 100)[0]
        p.placed(first.edge_id, 100)
        chosen.append(first.edge_id)
    assert set(chosen) == {"aaaa", "bbbb", "cccc"}


def test_pack_fills_the_fullest_that_fits_and_filters() -> None:
    p = Placement("pack")
    edges = [_edge("aaaa", 3950), _edge("bbbb", 0), _edge("cccc", 2000),
             _edge("dddd", 0, healthy=False), _edge("eeee", 0, backend="microvm")]  # fmt: skip
    assert [e.edge_id for e in p.order(edges, "container", 100)] == ["cccc", "bbbb"]
    assert p.order(edges, "container", 40)[0].edge_id == "aaaa"
    with pytest.raises(errors.NodeFull):
        p.order(edges, "container", 5000)
    with pytest.raises(errors.BackendUnavailable):
        p.order(edges, "qemu", 1)
    with pytest.raises(errors.Unavailable):
        p.order([edges[3]], "container", 1)
    with pytest.raises(errors.InvalidArgument):
        Placement("random")


def test_spread_over_many_edges_scores_a_sample_and_stays_even() -> None:
    p = Placement("spread")
    edges = [_edge(f"e{n:03d}", 0) for n in range(100)]
    counts: dict[str, int] = {}
    for _ in range(1000):  # 10 per edge if perfectly even
        first = p.order(edges, "container", 30, limit=3)[0]
        p.placed(first.edge_id, 30)
        counts[first.edge_id] = counts.get(first.edge_id, 0) + 1
    assert len(counts) == 100
    assert max(counts.values()) <= 14
    # Only one edge with room: the sample misses it most of the time; the full scan finds it.
    full = [_edge(f"f{n:03d}", 4000) for n in range(99)] + [_edge("room", 0)]
    assert [e.edge_id for e in p.order(full, "container", 100, limit=3)] == ["room"]


def test_a_new_report_replaces_the_placements_it_includes() -> None:
    p = Placement("spread")
    before = [_edge("aaaa", 0), _edge("bbbb", 200)]
    for _ in range(4):  # 400 MiB on aaaa since its report: bbbb has more room now
        p.placed("aaaa", 100)
    assert p.order(before, "container", 100)[0].edge_id == "bbbb"
    # the next reports include them (aaaa 400 MiB allocated, seen after the placements):
    # counted once, from the report, not again on top of it
    now = time.time()
    after = [_edge("aaaa", 400, seen=now), _edge("bbbb", 500, seen=now)]
    assert [e.edge_id for e in p.order(after, "container", 100)] == ["aaaa", "bbbb"]
    p.placed("bbbb", 300)  # after those reports: counted until the next one
    assert [e.edge_id for e in p.order(after, "container", 100)] == ["aaaa", "bbbb"]
    p.placed("aaaa", 500)
    assert [e.edge_id for e in p.order(after, "container", 100)] == ["bbbb", "aaaa"]
