"""``dsec image import-vm`` through the whole platform (CLI/SDK -> apiserver -> gRPC mTLS
-> edge): a small fake Debian disk is imported, listed with ``backend`` "vm", refused when
its name is taken or when it is no disk, and removed. No boot here: that is
``tests/integration/test_vm_import_boot.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import AlreadyExists, InvalidArgument
from dsec.edge.backends.vm import imports
from dsec.paths import Paths
from dsec.sdk import Client
from dsec.testing.image_data import private_data
from dsec.testing.platform import RunningPlatform, requirements_missing, running_platform
from tests.integration.fakedisk import ext4, mbr, rootfs

_MISSING = requirements_missing() or imports.missing()
pytestmark = [
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def platform() -> Iterator[tuple[RunningPlatform, Path]]:
    top = Path(tempfile.mkdtemp(prefix="dsec-e2e-vmimport-"))
    old = os.environ.get("DSEC_DATA")
    try:
        data = private_data(Paths.from_env().data, top)
        os.environ["DSEC_DATA"] = str(data)
        with running_platform() as p:
            yield p, data
    finally:
        if old is None:
            os.environ.pop("DSEC_DATA", None)
        else:
            os.environ["DSEC_DATA"] = old
        shutil.rmtree(top, ignore_errors=True)


def test_import_list_refuse_remove(platform: tuple[RunningPlatform, Path], tmp_path: Path) -> None:
    p, data = platform
    disk = tmp_path / "disk.raw"
    mbr(ext4(rootfs(tmp_path / "tree"), tmp_path / "root.ext4"), disk)
    dsec = [sys.executable, "-m", "dsec.cli.main"]
    res = subprocess.run([*dsec, "image", "import-vm", "--json", "testian", str(disk)],
                         env=p.env(), capture_output=True, text=True, timeout=200)  # fmt: skip
    assert res.returncode == 0, res.stderr
    image = json.loads(res.stdout)
    assert image["name"] == "testian"
    assert image["backend"] == "vm"
    assert "Testian 1, kernel 6.1.0-99-amd64, root /dev/vda2 (ext4)" in image["source"]
    assert (data / "vm-images" / "testian" / "disk.qcow2").exists()
    with Client(api_url=p.api_url, api_key=p.admin_key) as client:
        listed = [i for i in client.list_images() if i["name"] == "testian"]
        assert [i["backend"] for i in listed] == ["vm"]
        events: list[dict[str, Any]] = []
        with pytest.raises(AlreadyExists):
            client.import_vm_image(disk, "testian", progress=events.append)
        junk = tmp_path / "junk.img"
        junk.write_bytes(b"\x01" * (3 << 20))
        with pytest.raises(InvalidArgument, match="not a disk image"):
            client.import_vm_image(junk, "junk", progress=events.append)
        assert any(e["status"] == "uploading" and e["done"] == 3 << 20 for e in events)
        assert client.remove_image("testian")["removed"] == 1
        assert "testian" not in [i["name"] for i in client.list_images()]
    assert sorted(x.name for x in (data / "vm-images").iterdir()) == [".lock"]
