"""``dsec image build`` end to end: a multi-step image from ``base``, its config in the
sandboxes made from it, the step cache, and failures that leave nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import InvalidArgument
from dsec.paths import Paths
from dsec.sdk import Client, Sandbox
from dsec.testing.image_data import private_data
from dsec.testing.platform import RunningPlatform, requirements_missing, running_platform

_MISSING = requirements_missing()
pytestmark = [
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
    pytest.mark.timeout(600),
]

DOCKERFILE = """\
# an RL environment image
ARG GREETING=hi
FROM base
ARG GREETING
ENV APP_MODE=test \\
    APP_HOME=/srv/app
RUN useradd -m -u 1234 app && echo "$GREETING from RUN" > /srv-greeting
COPY --chown=app:app app/ /srv/app/
COPY note.txt /srv/
WORKDIR $APP_HOME
USER app
RUN echo "built by $(id -un) in $(pwd)" > built.txt
LABEL org.example.purpose=test
EXPOSE 8080
ENTRYPOINT ["/bin/sh", "-c", "echo started > /tmp/main.txt; exec sleep 600"]
"""
LAYER_STEPS = {5, 6, 7, 10}  # RUN, COPY, COPY, RUN (WORKDIR exists after the COPY)


@pytest.fixture(scope="module")
def platform() -> Iterator[RunningPlatform]:
    shared = Paths.from_env().data
    top = Path(tempfile.mkdtemp(prefix="dsec-e2e-build-"))
    old = os.environ.get("DSEC_DATA")
    try:
        os.environ["DSEC_DATA"] = str(private_data(shared, top))
        with running_platform() as p:
            yield p
    finally:
        if old is None:
            os.environ.pop("DSEC_DATA", None)
        else:
            os.environ["DSEC_DATA"] = old
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def client(platform: RunningPlatform) -> Iterator[Client]:
    with Client(api_url=platform.api_url, api_key=platform.admin_key) as c:
        yield c


def make_context(top: Path, dockerfile: str = DOCKERFILE) -> Path:
    ctx = top / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "hello.py").write_text("print('hello')\n")
    (ctx / "app" / "secret.key").write_text("do not ship\n")
    (ctx / ".dockerignore").write_text("**/*.key\n")
    (ctx / "note.txt").write_text("v1\n")
    (ctx / "Dockerfile").write_text(dockerfile)
    return ctx


class Steps:
    def __init__(self) -> None:
        self.current = 0
        self.cached: set[int] = set()
        self.ran: set[int] = set()
        self.log = ""

    def __call__(self, ev: dict[str, Any]) -> None:
        if "step" in ev:
            self.current = ev["step"]["index"]
            self.ran.add(self.current)
        elif ev.get("cached"):
            self.cached.add(self.current)
        elif "log" in ev:
            self.log += ev["log"]


def no_build_leftovers(client: Client) -> None:
    assert [s.id for s in client.list_sandboxes(False)] == []
    names = [i["name"] for i in client.list_images()]
    assert not [n for n in names if n.startswith("dsec-build/run-")]


def test_build_run_cache_and_rebuild(client: Client, tmp_path: Path) -> None:
    ctx = make_context(tmp_path)
    first = Steps()
    image = client.build_image(ctx, "e2e/env:v1", build_args={"GREETING": "hey"}, progress=first)
    assert first.ran == set(range(1, 14))
    assert first.cached == set()
    assert image["user"] == "app"
    assert image["workdir"] == "/srv/app"
    assert "APP_MODE=test" in image["env"]
    no_build_leftovers(client)

    sbx = Sandbox.create(image="e2e/env:v1", client=client, timeout=120)
    try:
        res = sbx.exec(
            "id -un; pwd; echo $APP_MODE; cat /srv-greeting built.txt /srv/note.txt; "
            "stat -c %U hello.py; ls /srv/app"
        )
        assert res.exit_code == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[:4] == ["app", "/srv/app", "test", "hey from RUN"]
        assert lines[4] == "built by app in /srv/app"
        assert lines[5:7] == ["v1", "app"]
        assert sorted(lines[7:]) == ["built.txt", "hello.py"]  # secret.key was ignored
        assert sbx.exec("id -un", user="root").stdout == "root\n"
        main = [p for p in sbx.processes.list() if p.tag == "main"]
        assert len(main) == 1
        assert main[0].running
        deadline = time.monotonic() + 10
        while sbx.exec("cat /tmp/main.txt").stdout != "started\n":
            assert time.monotonic() < deadline, "the entrypoint did not run"
            time.sleep(0.1)
    finally:
        sbx.kill()
        sbx.close()

    again = Steps()
    client.build_image(ctx, "e2e/env:v1", build_args={"GREETING": "hey"}, progress=again)
    assert again.cached == LAYER_STEPS

    (ctx / "note.txt").write_text("v2\n")
    third = Steps()
    client.build_image(ctx, "e2e/env:v2", build_args={"GREETING": "hey"}, progress=third)
    assert third.cached == {5, 6}  # the prefix before the changed COPY
    sbx = Sandbox.create(image="e2e/env:v2", client=client, timeout=120)
    try:
        assert sbx.exec("cat /srv/note.txt").stdout == "v2\n"
    finally:
        sbx.kill()
        sbx.close()

    forced = Steps()
    client.build_image(
        ctx, "e2e/env:v2", build_args={"GREETING": "hey"}, no_cache=True, progress=forced
    )
    assert forced.cached == set()
    no_build_leftovers(client)


def test_failing_run_and_bad_dockerfiles_leave_nothing(client: Client, tmp_path: Path) -> None:
    ctx = make_context(tmp_path, "FROM base\nCOPY note.txt /\nRUN echo oops-output; exit 3\n")
    with pytest.raises(InvalidArgument) as info:
        client.build_image(ctx, "e2e/broken:v1")
    msg = str(info.value)
    assert "Dockerfile line 3" in msg
    assert "exit code 3" in msg
    assert "oops-output" in msg
    no_build_leftovers(client)
    assert "e2e/broken:v1" not in [i["name"] for i in client.list_images()]

    (ctx / "Dockerfile").write_text("FROM base\nRUN true\nFETCH x\n")
    with pytest.raises(InvalidArgument, match="Dockerfile line 3: unknown instruction"):
        client.build_image(ctx, "e2e/broken:v1")
    (ctx / "Dockerfile").write_text("FROM base\nCOPY ../etc/passwd /x\n")
    with pytest.raises(InvalidArgument, match="outside the build context"):
        client.build_image(ctx, "e2e/broken:v1")
    (ctx / "Dockerfile").write_text("FROM base\nUSER ghost\nRUN true\n")
    with pytest.raises(InvalidArgument, match=r"Dockerfile line 3: RUN could not run.*ghost"):
        client.build_image(ctx, "e2e/broken:v1")
    (ctx / "Dockerfile").write_text("FROM nosuchimage\n")
    with pytest.raises(InvalidArgument, match=r"line 1.*nosuchimage"):
        client.build_image(ctx, "e2e/broken:v1")
    no_build_leftovers(client)


def test_cli_build_shows_steps_and_cached(platform: RunningPlatform, tmp_path: Path) -> None:
    ctx = make_context(tmp_path, 'FROM base\nCOPY note.txt /n.txt\nCMD ["cat", "/n.txt"]\n')
    dsec = [sys.executable, "-m", "dsec.cli.main", "image", "build"]
    for _ in range(2):
        res = subprocess.run(
            [*dsec, "-t", "e2e/cli:v1", str(ctx)],
            env=platform.env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr
    assert "Step 2/3 : COPY note.txt /n.txt" in res.stderr
    assert " ---> CACHED" in res.stderr
    assert "Built e2e/cli:v1" in res.stdout
