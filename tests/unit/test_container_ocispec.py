"""The OCI config and seccomp profile of a sandbox container."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

from dsec.core.spec import SandboxSpec
from dsec.edge.backends.container import ocispec, seccomp
from dsec.edge.images.store import Image, ImageConfig

SID = "sbx-e0a1-aaaaaaaaaaaaaaaaaaaa"


def _image(env: tuple[str, ...] = ()) -> Image:
    return Image(
        name="base",
        diff_ids=("a" * 64,),
        layer_dirs=(Path("/images/layers/sha256/" + "a" * 64),),
        config=ImageConfig(env=env),
        created="",
    )


def _config(spec: SandboxSpec | None = None, image: Image | None = None) -> dict[str, Any]:
    return ocispec.build_config(
        sandbox_id=SID,
        spec=spec or SandboxSpec(),
        image=image or _image(),
        rootfs=Path("/state/rootfs"),
        agent_bundle=Path("/data/agent"),
        cgroups_path=f"/dsec/{SID}",
    )


def test_process_and_namespaces() -> None:
    c = _config()
    assert c["process"]["args"] == ["/.dsec/init"]
    assert c["process"]["cwd"] == "/"
    assert c["process"]["user"] == {"uid": 0, "gid": 0}
    assert c["process"]["noNewPrivileges"] is False
    assert c["hostname"] == SID
    assert c["root"] == {"path": "/state/rootfs", "readonly": False}
    ns = {n["type"] for n in c["linux"]["namespaces"]}
    assert ns == {"pid", "mount", "uts", "ipc", "network", "cgroup"}
    assert all("path" not in n for n in c["linux"]["namespaces"])  # all new, none joined
    assert "user" not in ns
    assert c["linux"]["cgroupsPath"] == f"/dsec/{SID}"
    json.dumps(c)  # serialisable as is


def test_env_order_and_overrides() -> None:
    c = _config(
        SandboxSpec(env={"LANG": "de_DE.UTF-8", "FOO": "user", "DSEC_SANDBOX_ID": "spoof"}),
        _image(env=("PATH=/opt/bin:/usr/bin", "FOO=image", "BAR=image", "junk")),
    )
    env = c["process"]["env"]
    keys = [e.split("=", 1)[0] for e in env]
    assert keys[:6] == ["PATH", "HOME", "HOSTNAME", "TERM", "LANG", "DSEC_SANDBOX_ID"]
    as_dict = dict(e.split("=", 1) for e in env)
    assert as_dict["PATH"] == "/opt/bin:/usr/bin"  # image overrides the default
    assert as_dict["FOO"] == "user"  # user overrides the image
    assert as_dict["BAR"] == "image"
    assert as_dict["LANG"] == "de_DE.UTF-8"
    assert as_dict["TERM"] == "xterm-256color"
    assert as_dict["HOME"] == "/root"
    assert as_dict["DSEC_SANDBOX_ID"] == SID  # cannot be spoofed
    assert as_dict["HOSTNAME"] == SID
    assert len(keys) == len(set(keys))


def test_capabilities_are_the_documented_set() -> None:
    caps = _config()["process"]["capabilities"]
    chosen = set(ocispec.CAPABILITIES)
    for kind in ("bounding", "effective", "permitted"):
        assert set(caps[kind]) == chosen
    assert caps["inheritable"] == []
    assert caps["ambient"] == []
    for dangerous in (
        "CAP_SYS_ADMIN",
        "CAP_NET_ADMIN",
        "CAP_SYS_PTRACE",
        "CAP_SYS_MODULE",
        "CAP_NET_RAW",
        "CAP_MKNOD",
        "CAP_SYS_RAWIO",
        "CAP_DAC_READ_SEARCH",
        "CAP_SYS_TIME",
        "CAP_BPF",
    ):
        assert dangerous not in chosen
    # Same bits the kernel shows in /proc/<pid>/status (checked live in integration tests).
    assert ocispec.capability_mask() == 0xA00405FB


def test_resources_follow_the_spec() -> None:
    r = _config(SandboxSpec(memory_mb=256, cpu=0.5, pids=100))["linux"]["resources"]
    assert r["memory"] == {"limit": 256 * 2**20, "swap": 256 * 2**20}
    assert r["cpu"] == {"quota": 50_000, "period": 100_000}
    assert r["pids"] == {"limit": 100}
    assert r["devices"] == [{"allow": False, "access": "rwm"}]
    small = _config(SandboxSpec(cpu=0.05))["linux"]["resources"]["cpu"]
    assert small["quota"] == 5000


def test_mounts() -> None:
    c = _config()
    by_dest = {m["destination"]: m for m in c["mounts"]}
    for dest in ("/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys", "/sys/fs/cgroup"):
        assert dest in by_dest
    assert "ro" in by_dest["/sys"]["options"]
    assert "ro" in by_dest["/sys/fs/cgroup"]["options"]
    agent = by_dest["/.dsec"]
    assert agent["source"] == "/data/agent"
    assert {"ro", "nosuid", "nodev"} <= set(agent["options"])
    assert by_dest["/.dsec/run"]["type"] == "tmpfs"
    order = [m["destination"] for m in c["mounts"]]
    assert order.index("/.dsec") < order.index("/.dsec/run")
    assert "/proc/kcore" in c["linux"]["maskedPaths"]
    assert "/proc/sys" in c["linux"]["readonlyPaths"]


def test_seccomp_profile_denies_the_documented_groups() -> None:
    prof = _config()["linux"]["seccomp"]
    assert prof["defaultAction"] == "SCMP_ACT_ALLOW"
    denied: set[str] = set()
    for rule in prof["syscalls"]:
        if rule["action"] == "SCMP_ACT_ERRNO" and "args" not in rule:
            if rule["names"] == ["clone3"]:
                assert rule["errnoRet"] == errno.ENOSYS
                continue
            assert rule["errnoRet"] == errno.EPERM
            denied |= set(rule["names"])
    must = {
        "mount",
        "umount2",
        "unshare",
        "setns",
        "pivot_root",
        "keyctl",
        "add_key",
        "request_key",
        "bpf",
        "perf_event_open",
        "kexec_load",
        "kexec_file_load",
        "init_module",
        "finit_module",
        "delete_module",
        "reboot",
        "swapon",
        "swapoff",
        "open_by_handle_at",
        "name_to_handle_at",
        "iopl",
        "ioperm",
        "settimeofday",
        "clock_settime",
        "adjtimex",
        "acct",
        "syslog",
        "userfaultfd",
        "fsopen",
        "fsmount",
        "move_mount",
        "open_tree",
        "mount_setattr",
    }
    assert must <= denied
    assert "ptrace" not in denied  # deliberate, see the module docstring
    assert set(seccomp.denied_syscalls()) == denied


def test_seccomp_clone_namespace_flags() -> None:
    prof = seccomp.build_profile("x86_64")
    assert prof["architectures"][0] == "SCMP_ARCH_X86_64"
    clone_rules = [r for r in prof["syscalls"] if r["names"] == ["clone"]]
    flags = set()
    for rule in clone_rules:
        (arg,) = rule["args"]
        assert arg["index"] == 0
        assert arg["op"] == "SCMP_CMP_MASKED_EQ"
        assert arg["value"] == arg["valueTwo"]
        flags.add(arg["value"])
    assert flags == set(seccomp.CLONE_NAMESPACE_FLAGS.values())
    assert 0x10000000 in flags  # CLONE_NEWUSER


def test_write_config(tmp_path: Path) -> None:
    path = ocispec.write_config(tmp_path, _config())
    assert path == tmp_path / "config.json"
    assert (path.stat().st_mode & 0o777) == 0o600
    assert json.loads(path.read_text())["hostname"] == SID


def test_image_user_and_workdir_reach_the_agent_only_when_set() -> None:
    env = ocispec.build_env("sbx-e0a1-x", (), {}, image_user="app:app", image_workdir="/srv")
    assert "DSEC_IMAGE_USER=app:app" in env
    assert "DSEC_IMAGE_WORKDIR=/srv" in env
    plain = ocispec.build_env("sbx-e0a1-x", (), {})
    assert not [e for e in plain if e.startswith("DSEC_IMAGE_")]


def test_main_command_is_entrypoint_plus_cmd_only_with_an_entrypoint() -> None:
    assert ImageConfig(cmd=("/bin/bash",)).main_command() == ()
    cfg = ImageConfig(entrypoint=("python3", "-m", "srv"), cmd=("--port", "1"))
    assert cfg.main_command() == ("python3", "-m", "srv", "--port", "1")
