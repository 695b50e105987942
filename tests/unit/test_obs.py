"""Metrics: counters, gauges and histograms rendered in the Prometheus text format."""

from __future__ import annotations

from dsec.obs import Metrics


def test_series_are_one_whatever_the_order_of_their_labels() -> None:
    m = Metrics("t")
    m.inc("calls", method="Get", code="OK")
    m.inc("calls", 2.0, code="OK", method="Get")
    m.inc("calls", code="NOT_FOUND", method="Get")
    m.set("edges", 3.0, zone="a", kind="x")
    m.set("edges", 4.0, kind="x", zone="a")  # the later value wins
    m.set("edges", 5.0, zone="a", kind="x")  # ... again, in the first order
    lines = m.render().splitlines()
    assert 't_calls_total{code="OK",method="Get"} 3' in lines
    assert 't_calls_total{code="NOT_FOUND",method="Get"} 1' in lines
    assert [ln for ln in lines if ln.startswith("t_edges")] == ['t_edges{kind="x",zone="a"} 5']


def test_histogram_buckets_are_cumulative() -> None:
    m = Metrics("t")
    for seconds, labels in ((0.001, {"a": "1", "b": "2"}), (0.003, {"b": "2", "a": "1"}),
                            (0.3, {"a": "1", "b": "2"}), (60.0, {"a": "1", "b": "2"})):  # fmt: skip
        m.observe("rpc", seconds, **labels)
    got = {}
    for line in m.render().splitlines():
        name, _, value = line.rpartition(" ")
        got[name] = float(value)
    bucket = 't_rpc_seconds_bucket{{a="1",b="2",le="{}"}}'.format
    assert got[bucket("0.001")] == 1  # an observation on a bound counts in that bucket
    assert got[bucket("0.0025")] == 1
    assert got[bucket("0.005")] == 2
    assert got[bucket("0.25")] == 2
    assert got[bucket("0.5")] == 3
    assert got[bucket("10")] == 3
    assert got[bucket("+Inf")] == 4
    assert got['t_rpc_seconds_count{a="1",b="2"}'] == 4
    assert abs(got['t_rpc_seconds_sum{a="1",b="2"}'] - 60.304) < 1e-6


def test_label_values_are_escaped() -> None:
    m = Metrics("t")
    m.inc("errors", reason='bad "x"\\y\nz')
    assert 't_errors_total{reason="bad \\"x\\"\\\\y\\nz"} 1' in m.render().splitlines()
