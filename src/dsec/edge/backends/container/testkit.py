"""Helpers for tests that run real containers (also usable before the agent bundle exists).

A fake agent bundle is a directory whose ``init`` is a shell script that stays up, so a
container can be inspected with ``crun exec``. :func:`container_test_env` builds a complete
throw-away node (data, home and run dirs, an image store holding ``base``, a unique
cgroup parent) and removes all of it afterwards, including the persistent crun namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dsec.core.ids import new_sandbox_id
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import cgroups, mounts
from dsec.edge.backends.container.backend import ContainerBackend
from dsec.edge.images.base import BASE_IMAGE, install_base_from_tar
from dsec.edge.images.store import ImageStore
from dsec.paths import Paths

# Stays pid 1 under its own name (``/bin/sh /.dsec/init``) so tests can recognise it.
FAKE_INIT = "#!/bin/sh\n# fake aether init for tests\nwhile :; do sleep 100000; done\n"


def make_fake_agent_bundle(path: Path, init_script: str = FAKE_INIT) -> Path:
    """Create (or overwrite) a bundle at ``path`` with a shell ``init``; return ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "run").mkdir(exist_ok=True)
    init = path / "init"
    init.write_text(init_script)
    os.chmod(init, 0o755)
    return path


def base_tar() -> Path | None:
    """A prebuilt base tar to import instead of the installed image (``$DSEC_TEST_BASE_TAR``)."""
    value = os.environ.get("DSEC_TEST_BASE_TAR")
    return Path(value) if value else None


def installed_store() -> ImageStore:
    """The image store ``dsec setup`` built (tests only read its layers)."""
    return ImageStore(Paths.from_env().images)


def skip_reason(tar: Path | None = None) -> str | None:
    """Why real-container tests cannot run here, or None if they can."""
    tar = tar or base_tar()
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("crun") is None:
        return "needs crun (apt-get install crun)"
    try:
        with open("/proc/filesystems") as f:
            if "overlay" not in f.read():
                return "needs overlayfs"
    except OSError:
        return "cannot read /proc/filesystems"
    if tar is not None and not tar.is_file():
        return f"DSEC_TEST_BASE_TAR={tar} is not a file"
    if tar is None and not installed_store().has(BASE_IMAGE):
        return "the base image is not built (run scripts/install or `dsec setup`)"
    return None


@dataclass
class ContainerTestEnv:
    """A throw-away node for container tests."""

    root: Path
    paths: Paths
    store: ImageStore
    cgroup_parent: str

    def backend(self) -> ContainerBackend:
        return ContainerBackend(
            self.paths, "e0a1", image_store=self.store, cgroup_parent=self.cgroup_parent
        )

    def sandbox(self) -> tuple[str, SandboxPaths]:
        """A fresh sandbox id and its paths (state dir under the shared sandboxes dir)."""
        sid = new_sandbox_id("e0a1", os.urandom(13))
        return sid, SandboxPaths(
            state_dir=self.paths.home / "edge" / "sandboxes" / sid,
            agent_socket=self.paths.run / "sbx" / f"{sid}.sock",
        )

    def _unmount_leftovers(self, skip: set[str]) -> list[str]:
        return _unmount_leftovers_impl((self.paths.home, self.paths.run, self.paths.data), skip)

    def close(self) -> list[str]:
        """Remove everything; return what could not be removed."""
        problems: list[str] = []
        backend = self.backend()
        layout = cgroups.detect()
        problems.extend(
            f"cgroup left: {p}" for p in cgroups.list_children(layout, self.cgroup_parent)
        )
        problems.extend(str(p) for p in cgroups.remove(layout, "/" + self.cgroup_parent))
        ours = {str(backend.sandboxes_dir), str(self.paths.run / "crun.mntns")}
        problems.extend(self._unmount_leftovers(skip=ours))
        backend.release_host_setup()
        problems.extend(self._unmount_leftovers(skip=set()))  # any hidden below the bind
        for d in (self.paths.run, self.root):
            shutil.rmtree(d, ignore_errors=True)
        return problems


_shared_stores: dict[Path, ImageStore] = {}


def shared_base_store(tar: Path | None = None) -> ImageStore:
    """An image store holding ``base``: the installed one, or ``tar`` unpacked once per process.

    Unpacking takes seconds, so every test module of a pytest run shares one copy; it is
    removed when the process exits.
    """
    tar = tar or base_tar()
    if tar is None:
        return installed_store()
    store = _shared_stores.get(tar)
    if store is None:
        root = Path(tempfile.mkdtemp(prefix="dsec-ctest-images-"))
        atexit.register(shutil.rmtree, root, True)
        store = ImageStore(root)
        install_base_from_tar(store, tar)
        _shared_stores[tar] = store
    return store


def _unmount_leftovers_impl(dirs: tuple[Path, ...], skip: set[str]) -> list[str]:
    problems: list[str] = []
    for d in dirs:
        for m in reversed(mounts.mounts_under(d)):
            if m.mount_point in skip:
                continue
            with contextlib.suppress(OSError):
                mounts.umount(m.mount_point, mounts.MNT_DETACH)
            problems.append(f"mount left: {m.mount_point}")
    return problems


@contextlib.contextmanager
def container_test_env(tar: Path | None = None) -> Iterator[ContainerTestEnv]:
    """Yield a :class:`ContainerTestEnv` with ``base`` from ``tar``; clean up after.

    The image store is shared by every environment of the process (see
    :func:`shared_base_store`); everything else is private to this environment.
    """
    root = Path(tempfile.mkdtemp(prefix="dsec-ctest-"))
    run = Path(tempfile.mkdtemp(prefix="dsec", dir="/tmp"))  # short: unix socket paths
    paths = Paths(home=root / "home", data=root / "data", run=run)
    env = ContainerTestEnv(
        root=root,
        paths=paths,
        store=ImageStore(paths.images),
        cgroup_parent=f"dsectest-{os.urandom(4).hex()}",
    )
    try:
        env.store = shared_base_store(tar)
        assert env.store.has(BASE_IMAGE)
        make_fake_agent_bundle(paths.agent_bundle)
        yield env
    finally:
        problems = env.close()
    if problems:
        raise AssertionError("container tests left state behind: " + "; ".join(problems))
