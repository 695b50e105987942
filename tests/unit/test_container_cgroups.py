"""Cgroup mode detection and usage reading against fake /sys/fs/cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.core.errors import BackendUnavailable
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.container.cgroups import CgroupMode

V1_DIRS = ("cpu,cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd")


def _hierarchy(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("")
    return d


def make_v1(root: Path) -> Path:
    for name in V1_DIRS:
        _hierarchy(root / name)
    (root / "cpu").symlink_to("cpu,cpuacct")
    (root / "cpuacct").symlink_to("cpu,cpuacct")
    return root


def make_hybrid(root: Path, controllers: str) -> Path:
    make_v1(root)
    unified = _hierarchy(root / "unified")
    (unified / "cgroup.controllers").write_text(controllers + "\n")
    return root


def make_v2(root: Path) -> Path:
    _hierarchy(root)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    return root


def test_detect_v2(tmp_path: Path) -> None:
    layout = cgroups.detect(make_v2(tmp_path))
    assert layout.mode is CgroupMode.V2
    assert layout.unified == tmp_path
    assert "memory" in layout.unified_controllers
    assert not layout.crun_needs_private_ns
    assert layout.hierarchies() == (tmp_path,)
    assert layout.controller_dir("memory", "/dsec/x") == tmp_path / "dsec" / "x"


def test_detect_v1(tmp_path: Path) -> None:
    layout = cgroups.detect(make_v1(tmp_path))
    assert layout.mode is CgroupMode.V1
    assert layout.unified is None
    assert not layout.crun_needs_private_ns
    assert layout.controller_dir("memory", "/dsec/x") == tmp_path / "memory" / "dsec" / "x"
    # cpu and cpuacct share one hierarchy, reached through the symlinks or the real name.
    assert layout.controller_dir("cpu", "dsec") is not None
    assert len(layout.hierarchies()) == len(V1_DIRS)


def test_detect_hybrid_with_controllers_needs_private_ns(tmp_path: Path) -> None:
    layout = cgroups.detect(make_hybrid(tmp_path, "hugetlb"))
    assert layout.mode is CgroupMode.HYBRID
    assert layout.unified_controllers == ("hugetlb",)
    assert layout.crun_needs_private_ns
    assert tmp_path / "unified" in layout.hierarchies()
    assert "unified" not in layout.v1
    assert "hybrid" in layout.describe()
    assert "hugetlb" in layout.describe()


def test_detect_hybrid_without_controllers(tmp_path: Path) -> None:
    layout = cgroups.detect(make_hybrid(tmp_path, ""))
    assert layout.mode is CgroupMode.HYBRID
    assert layout.unified_controllers == ()
    assert not layout.crun_needs_private_ns


def test_detect_nothing_mounted(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable):
        cgroups.detect(tmp_path)
    with pytest.raises(BackendUnavailable):
        cgroups.detect(tmp_path / "missing")


def test_read_usage_v1(tmp_path: Path) -> None:
    layout = cgroups.detect(make_v1(tmp_path))
    mem = tmp_path / "memory" / "dsec" / "s1"
    mem.mkdir(parents=True)
    (mem / "memory.usage_in_bytes").write_text("3000000\n")
    (mem / "memory.stat").write_text("cache 10\ntotal_inactive_file 1000000\n")
    (mem / "memory.limit_in_bytes").write_text("67108864\n")
    (mem / "memory.failcnt").write_text("7\n")
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    cpu = tmp_path / "cpu,cpuacct" / "dsec" / "s1"
    cpu.mkdir(parents=True)
    (cpu / "cpuacct.usage").write_text("2500000000\n")
    (cpu / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 500000000\n")
    pids = tmp_path / "pids" / "dsec" / "s1"
    pids.mkdir(parents=True)
    (pids / "pids.current").write_text("12\n")
    (pids / "pids.events").write_text("max 3\n")

    u = cgroups.read_usage(layout, "/dsec/s1")
    assert u["memory_bytes"] == 2_000_000
    assert u["memory_limit_bytes"] == 64 * 2**20
    assert u["memory_failcnt"] == 7
    assert u["oom_kills"] == 2
    assert u["cpu_seconds"] == pytest.approx(2.5)
    assert u["cpu_throttled_periods"] == 4
    assert u["cpu_throttled_seconds"] == pytest.approx(0.5)
    assert u["pids"] == 12
    assert u["pids_limit_hits"] == 3


def test_read_usage_v2(tmp_path: Path) -> None:
    layout = cgroups.detect(make_v2(tmp_path))
    d = tmp_path / "dsec" / "s1"
    d.mkdir(parents=True)
    (d / "memory.current").write_text("5000\n")
    (d / "memory.stat").write_text("anon 4000\ninactive_file 1000\n")
    (d / "memory.max").write_text("max\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    (d / "cpu.stat").write_text("usage_usec 1500000\nnr_throttled 2\nthrottled_usec 250000\n")
    (d / "pids.current").write_text("3\n")

    u = cgroups.read_usage(layout, "dsec/s1")
    assert u["memory_bytes"] == 4000
    assert "memory_limit_bytes" not in u  # "max" is no number
    assert u["oom_kills"] == 1
    assert u["cpu_seconds"] == pytest.approx(1.5)
    assert u["cpu_throttled_seconds"] == pytest.approx(0.25)
    assert u["pids"] == 3


def test_read_usage_missing_cgroup_is_empty(tmp_path: Path) -> None:
    layout = cgroups.detect(make_hybrid(tmp_path, "hugetlb"))
    assert cgroups.read_usage(layout, "/dsec/gone") == {}


def test_sandbox_cgroups_and_children(tmp_path: Path) -> None:
    layout = cgroups.detect(make_hybrid(tmp_path, "hugetlb"))
    for h in ("memory", "pids", "unified"):
        (tmp_path / h / "dsec" / "a").mkdir(parents=True)
    (tmp_path / "memory" / "dsec" / "b").mkdir()
    found = cgroups.sandbox_cgroups(layout, "/dsec/a")
    assert sorted(p.parent.parent.name for p in found) == ["memory", "pids", "unified"]
    children = cgroups.list_children(layout, "dsec")
    assert sorted(p.name for p in children) == ["a", "a", "a", "b"]


def test_remove_deletes_empty_cgroups(tmp_path: Path) -> None:
    # Plain directories stand in for cgroups: rmdir of an empty one works the same.
    layout = cgroups.detect(make_v1(tmp_path))
    for h in ("memory", "pids"):
        (tmp_path / h / "dsec" / "a").mkdir(parents=True)
    assert cgroups.remove(layout, "/dsec/a") == []
    assert cgroups.sandbox_cgroups(layout, "/dsec/a") == []
    assert (tmp_path / "memory" / "dsec").is_dir()  # the parent stays
