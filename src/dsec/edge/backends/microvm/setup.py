"""What ``dsec setup`` prepares for the microVM backend (cached; fast when done)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

from dsec.edge.backends.microvm import disks, kernel, qemu
from dsec.paths import Paths


def missing() -> str | None:
    """Why the microVM backend cannot be prepared here (None when it can)."""
    if not kernel.SOURCE_TAR.exists():
        return f"{kernel.SOURCE_TAR} is missing (apt-get install {kernel.SOURCE_PACKAGE})"
    for tool in ("make", "gcc", "mkfs.erofs", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return qemu.available()


def prepare(paths: Paths, progress: Callable[[str], None], *, build_kernel: bool = True) -> None:
    """Build the guest kernel (unless ``build_kernel`` is False: ``dsec setup --no-kernel``,
    the kernel builds beside it), the initramfs, the bundle image and the scratch base;
    none of the images needs the kernel."""
    from dsec.core.errors import ImageNotFound
    from dsec.edge.images.store import ImageStore

    if build_kernel:
        kernel.build_kernel(paths.data, progress)
    vm_dir = kernel.vm_dir(paths.data)
    vm_dir.mkdir(parents=True, exist_ok=True)
    progress("microVM images: initramfs, agent bundle, scratch disk base")
    disks.initramfs(vm_dir)
    disks.bundle_image(paths.agent_bundle, vm_dir)
    disks.scratch_base(vm_dir)
    store = ImageStore(paths.images)
    try:
        image = store.resolve("base")
    except ImageNotFound:  # no base image: nothing to pre-build
        return
    progress("microVM images: erofs of the base image's layers")
    for d in image.layer_dirs:
        disks.layer_image(d)
