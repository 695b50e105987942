"""Observability: structured log lines and Prometheus-style metrics for every daemon.

Logs are JSON objects, one per line, on stderr (the supervisor sends them to
``<home>/logs/<component>.log``). Metrics are counters, gauges and histograms kept in
process and rendered in the Prometheus text format at ``/metrics``.
"""

from __future__ import annotations

import bisect
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _JsonFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "component": self.component,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(component: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def log(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields: object) -> None:
    """Log ``msg`` with structured ``fields`` (they become keys of the JSON line)."""
    logger.log(level, msg, extra={"fields": fields})


class Metrics:
    """A small thread-safe registry; names follow Prometheus conventions.

    A counter or histogram series is kept under its labels in the order the caller gave
    them (no sort on the hot path: a call site always names them in the same order);
    :meth:`render` merges series whose labels differ only in order. A gauge is kept under
    its sorted labels, so the value set last wins whatever order each call named them in.
    A histogram keeps a count per bucket, summed into Prometheus's cumulative buckets when
    rendered.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        # per bucket (the last one: above every bound), then count and sum
        self._hist: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
        self._help: dict[str, str] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(labels.items()))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._gauges[(name, tuple(sorted(labels.items())))] = value

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        key = (name, tuple(labels.items()))
        bucket = bisect.bisect_left(_BUCKETS, seconds)  # the first bound >= seconds
        with self._lock:
            h = self._hist.get(key)
            if h is None:
                h = self._hist[key] = [0.0] * (len(_BUCKETS) + 3)
            h[bucket] += 1
            h[-2] += 1  # count
            h[-1] += seconds  # sum

    @contextmanager
    def timed(self, name: str, **labels: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(name, time.perf_counter() - start, **labels)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            counters, gauges = _merged(self._counters, sum), dict(self._gauges)
            hists = _merged(self._hist, _add_lists)
        for (name, labels), v in sorted(counters.items()):
            lines.append(f"{self.prefix}_{name}_total{_fmt(labels)} {v:g}")
        for (name, labels), v in sorted(gauges.items()):
            lines.append(f"{self.prefix}_{name}{_fmt(labels)} {v:g}")
        for (name, labels), h in sorted(hists.items()):
            full = f"{self.prefix}_{name}_seconds"
            below = 0.0
            for i, bound in enumerate(_BUCKETS):
                below += h[i]
                lines.append(f"{full}_bucket{_fmt((*labels, ('le', f'{bound:g}')))} {below:g}")
            lines.append(f"{full}_bucket{_fmt((*labels, ('le', '+Inf')))} {h[-2]:g}")
            lines.append(f"{full}_count{_fmt(labels)} {h[-2]:g}")
            lines.append(f"{full}_sum{_fmt(labels)} {h[-1]:.6f}")
        return "\n".join(lines) + "\n"


_Key = tuple[str, tuple[tuple[str, str], ...]]
_T = TypeVar("_T")


def _merged(series: dict[_Key, _T], combine: Callable[[list[_T]], _T]) -> dict[_Key, _T]:
    """``series`` keyed by their sorted labels; values of the same series combined."""
    groups: dict[_Key, list[_T]] = {}
    for (name, labels), v in series.items():
        groups.setdefault((name, tuple(sorted(labels))), []).append(v)
    return {k: vs[0] if len(vs) == 1 else combine(vs) for k, vs in groups.items()}


def _add_lists(values: list[list[float]]) -> list[float]:
    return [sum(col) for col in zip(*values, strict=True)]


def _fmt(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels)
    return "{" + body + "}"


def _escaped(value: str) -> str:
    """A label value as the text format writes it: backslash, quote and newline escaped."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value
