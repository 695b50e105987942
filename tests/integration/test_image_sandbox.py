"""A sandbox created from an image pulled out of a real registry uses the image's config."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec.core.spec import SandboxSpec
from dsec.edge.backends.container import testkit
from dsec.edge.backends.container.testkit import ContainerTestEnv
from dsec.edge.images.base import BASE_IMAGE
from dsec.edge.images.pull import Puller, PullOptions
from dsec.edge.images.store import ImageStore
from dsec.testing import registry as testreg
from dsec.testing.registry import TarBuilder, base_slice_tar, local_registry, push_image

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cenv() -> Iterator[ContainerTestEnv]:
    reason = testkit.skip_reason() or testreg.skip_reason()
    if reason:
        pytest.skip(reason)
    with testkit.container_test_env() as env:
        yield env


@pytest.mark.asyncio
async def test_sandbox_from_pulled_image_has_its_env_and_workdir(cenv: ContainerTestEnv) -> None:
    base = base_slice_tar(cenv.store.resolve(BASE_IMAGE).layer_dirs[-1])
    app = TarBuilder().dir("work").file("work/hello.txt", b"from the image\n").build()
    store = ImageStore(cenv.root / "pulled")
    with local_registry() as reg:
        push_image(
            reg,
            "sbx/app:v1",
            [base, app],
            compress=False,
            config={
                "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello"],
                "WorkingDir": "/work",
                "Cmd": ["/bin/bash"],
            },
        )
        image = Puller(store).pull(f"{reg.host}/sbx/app:v1", PullOptions(insecure=True))
    assert image.config.workdir == "/work"
    backend = cenv.backend()
    backend.images = store
    sid, paths = cenv.sandbox()
    await backend.create(sid, SandboxSpec(image=image.name, env={"MINE": "1"}), paths)
    try:
        res = await backend.crun.exec(
            sid, ["/bin/sh", "-c", "tr '\\0' '\\n' < /proc/1/environ; readlink /proc/1/cwd"]
        )
        assert res.returncode == 0, res.stderr
        lines = res.stdout.decode().splitlines()
        assert "GREETING=hello" in lines
        assert "MINE=1" in lines
        assert lines[-1] == "/work"
        cat = await backend.crun.exec(sid, ["cat", "/work/hello.txt"])
        assert cat.stdout == b"from the image\n"
    finally:
        await backend.destroy(sid, paths)
        assert backend.leaked(sid, paths) == []
