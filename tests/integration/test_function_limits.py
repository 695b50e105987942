"""Worker cgroups are reused between calls: a later call may need a higher limit."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dsec.edge.backends.container import cgroups
from dsec.edge.backends.function.limits import WorkerCgroups


@pytest.fixture
def worker_cgroups() -> Iterator[WorkerCgroups]:
    if os.geteuid() != 0:
        pytest.skip("needs root to make cgroups")
    w = WorkerCgroups(cgroups.detect(), f"dsec-test-limits-{os.getpid()}")
    yield w
    cgroups.remove_if_empty(w.layout, w.parent)


def test_a_reused_cgroup_takes_a_higher_memory_limit(worker_cgroups: WorkerCgroups) -> None:
    rel = worker_cgroups.make("w1")
    try:
        worker_cgroups.set_limits(rel, 64, 0.5, 32)  # a small call first
        worker_cgroups.set_limits(rel, 512, 1.0, 64)  # then a larger one in the same cgroup
        mem = worker_cgroups.layout.controller_dir("memory", rel)
        assert mem is not None
        name = "memory.limit_in_bytes" if "memory" in worker_cgroups.layout.v1 else "memory.max"
        assert int((mem / name).read_text()) == 512 * 1024 * 1024
    finally:
        assert worker_cgroups.remove(rel) == []
