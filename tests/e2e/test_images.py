"""Images end to end: a registry on loopback -> SDK/CLI pull -> sandbox from the image.

The platform here runs on its own data dir (the shared agent bundle and base layer are
linked in), so the images it pulls never land in the shared store under ``DSEC_DATA``.
"""

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

import httpx
import pytest

from dsec.core.errors import ImageNotFound, InvalidArgument, Unauthenticated
from dsec.edge.images.store import ImageStore
from dsec.paths import Paths
from dsec.sdk import Client, Sandbox
from dsec.testing import registry as testreg
from dsec.testing.image_data import private_data
from dsec.testing.platform import RunningPlatform, requirements_missing, running_platform
from dsec.testing.registry import (
    LocalRegistry,
    TarBuilder,
    base_slice_tar,
    local_registry,
    push_image,
)

_MISSING = requirements_missing() or testreg.skip_reason()
pytestmark = [
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[RunningPlatform, LocalRegistry, LocalRegistry, Path]]:
    shared = Paths.from_env().data
    top = Path(tempfile.mkdtemp(prefix="dsec-e2e-images-"))
    old = os.environ.get("DSEC_DATA")
    try:
        os.environ["DSEC_DATA"] = str(private_data(shared, top))
        with (
            local_registry() as reg,
            local_registry(username="bob", password="pw") as authreg,
            running_platform() as p,
        ):
            yield p, reg, authreg, shared
    finally:
        if old is None:
            os.environ.pop("DSEC_DATA", None)
        else:
            os.environ["DSEC_DATA"] = old
        shutil.rmtree(top, ignore_errors=True)


def _image(reg: LocalRegistry, shared: Path, name: str) -> None:
    base = base_slice_tar(ImageStore(shared / "images").resolve("base").layer_dirs[-1])
    app = TarBuilder().dir("work").file("work/hello.txt", b"from the image\n").build()
    push_image(
        reg,
        name,
        [base, app],
        config={"Env": ["PATH=/usr/bin:/bin", "GREETING=hello"], "WorkingDir": "/work"},
    )


def test_sdk_pull_then_sandbox(
    setup: tuple[RunningPlatform, LocalRegistry, LocalRegistry, Path],
) -> None:
    platform, reg, _, shared = setup
    _image(reg, shared, "e2e/app:v1")
    ref = f"{reg.host}/e2e/app:v1"
    events: list[dict[str, Any]] = []
    with Client(api_url=platform.api_url, api_key=platform.admin_key) as client:
        images = client.pull_image(ref, insecure=True, progress=events.append)
        assert [i["name"] for i in images] == [ref]
        assert images[0]["workdir"] == "/work"
        assert {e["status"] for e in events} >= {"downloading", "done"}
        assert ref in [i["name"] for i in client.list_images()]
        with pytest.raises(InvalidArgument):
            client.pull_image("Not A Ref", insecure=True)
        sbx = Sandbox.create(image=ref, client=client, timeout=120)
        try:
            res = sbx.exec("echo $GREETING; cat /work/hello.txt")
            assert res.stdout == "hello\nfrom the image\n"
        finally:
            sbx.kill()
            sbx.close()
        plain = httpx.post(  # without "stream": one JSON answer at the end
            f"{platform.api_url}/v1/images/pull",
            json={"reference": ref, "insecure": True},
            headers={"Authorization": f"Bearer {platform.admin_key}"},
            timeout=120,
        )
        assert plain.status_code == 200, plain.text
        assert [i["name"] for i in plain.json()["images"]] == [ref]
        client.remove_image(ref)
        assert ref not in [i["name"] for i in client.list_images()]
        with pytest.raises(ImageNotFound):
            client.remove_image(ref)
        gc = client.gc_images()
        assert gc["edges"][0]["layers"] == 2


def test_cli_login_pull_and_auth_error(
    setup: tuple[RunningPlatform, LocalRegistry, LocalRegistry, Path],
) -> None:
    platform, _, authreg, shared = setup
    _image(authreg, shared, "e2e/private:v1")
    ref = f"{authreg.host}/e2e/private:v1"
    env = platform.env()
    dsec = [sys.executable, "-m", "dsec.cli.main"]
    res = subprocess.run(
        [*dsec, "image", "pull", "--insecure", ref], env=env, capture_output=True, timeout=120
    )
    assert res.returncode == 2, res.stderr
    assert b"authentication required" in res.stderr
    with (
        Client(api_url=platform.api_url, api_key=platform.admin_key) as client,
        pytest.raises(Unauthenticated),
    ):
        client.pull_image(ref, insecure=True)
    login = [*dsec, "registry", "login", authreg.host, "-u", "bob", "-p", "pw", "--insecure"]
    subprocess.run(login, env=env, check=True, capture_output=True, timeout=60)
    res = subprocess.run(
        [*dsec, "image", "pull", "--json", ref], env=env, capture_output=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["name"] == ref


def test_pack_then_sandbox_from_the_packed_image(
    setup: tuple[RunningPlatform, LocalRegistry, LocalRegistry, Path],
) -> None:
    platform, reg, _, shared = setup
    _image(reg, shared, "e2e/packbase:v1")
    ref = f"{reg.host}/e2e/packbase:v1"
    with Client(api_url=platform.api_url, api_key=platform.admin_key) as client:
        client.pull_image(ref, insecure=True)
        first = Sandbox.create(image=ref, client=client, timeout=120)
        try:
            made = first.exec(
                "mkdir -p /srv && echo packed > /srv/state && rm /work/hello.txt "
                "&& mkdir -p /work/sub && echo x > /work/sub/y"
            )
            assert made.exit_code == 0, made.stderr
            packed = first.pack("local/packed:1")
        finally:
            first.kill()
            first.close()
        assert packed["name"] == "local/packed:1"
        assert len(packed["layers"]) == 3
        assert packed["workdir"] == "/work"
        second = Sandbox.create(image="local/packed:1", client=client, timeout=120)
        try:
            res = second.exec("cat /srv/state; ls /work; echo $GREETING")
            assert res.stdout == "packed\nsub\nhello\n"
        finally:
            second.kill()
            second.close()
        with pytest.raises(InvalidArgument):
            Sandbox.create(image="local/packed:1", client=client, timeout=60).pack("Bad Name")


def test_pack_push_then_pull_back(
    setup: tuple[RunningPlatform, LocalRegistry, LocalRegistry, Path],
) -> None:
    platform, reg, _, shared = setup
    _image(reg, shared, "e2e/pushbase:v1")
    ref = f"{reg.host}/e2e/pushbase:v1"
    target = f"{reg.host}/e2e/pushed:v1"
    with Client(api_url=platform.api_url, api_key=platform.admin_key) as client:
        client.pull_image(ref, insecure=True)
        sbx = Sandbox.create(image=ref, client=client, timeout=120)
        try:
            assert sbx.exec("echo pushed > /work/state").exit_code == 0
            sbx.pack(target, push=True, insecure=True)
        finally:
            sbx.kill()
            sbx.close()
        client.remove_image(target)
        client.gc_images()
        client.pull_image(target, insecure=True)
        again = Sandbox.create(image=target, client=client, timeout=120)
        try:
            assert again.exec("cat /work/state /work/hello.txt").stdout == (
                "pushed\nfrom the image\n"
            )
        finally:
            again.kill()
            again.close()


def test_cli_save_then_load_and_sandbox(
    setup: tuple[RunningPlatform, LocalRegistry, LocalRegistry, Path], tmp_path: Path
) -> None:
    """save -> rm + gc -> load (under a new name too) -> a sandbox from the loaded image."""
    platform, reg, _, shared = setup
    _image(reg, shared, "e2e/savebase:v1")
    ref = f"{reg.host}/e2e/savebase:v1"
    env = platform.env()
    dsec = [sys.executable, "-m", "dsec.cli.main"]
    out = tmp_path / "app.tar"
    with Client(api_url=platform.api_url, api_key=platform.admin_key) as client:
        client.pull_image(ref, insecure=True)
        res = subprocess.run(
            [*dsec, "image", "save", ref, "-o", str(out)], env=env, capture_output=True, timeout=120
        )
        assert res.returncode == 0, res.stderr
        assert out.stat().st_size > 0
        client.remove_image(ref)
        client.gc_images()
        res = subprocess.run(
            [*dsec, "image", "load", "--json", str(out)], env=env, capture_output=True, timeout=120
        )
        assert res.returncode == 0, res.stderr
        assert [i["name"] for i in json.loads(res.stdout)] == [ref]
        events: list[dict[str, Any]] = []
        loaded = client.load_image(out, name="local/loaded:1", progress=events.append)
        assert [i["name"] for i in loaded] == ["local/loaded:1"]
        assert {e["status"] for e in events} >= {"verified", "exists"}
        sbx = Sandbox.create(image="local/loaded:1", client=client, timeout=120)
        try:
            assert sbx.exec("echo $GREETING; cat /work/hello.txt").stdout == (
                "hello\nfrom the image\n"
            )
        finally:
            sbx.kill()
            sbx.close()
        cut = tmp_path / "cut.tar"
        cut.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
        with pytest.raises(InvalidArgument):
            client.load_image(cut, name="local/cut:1")
        assert "local/cut:1" not in [i["name"] for i in client.list_images()]
        with pytest.raises(ImageNotFound):
            client.save_image("local/nope:1", tmp_path / "nope.tar")
        assert not (tmp_path / "nope.tar").exists()
        assert not list(tmp_path.glob(".*.part"))
