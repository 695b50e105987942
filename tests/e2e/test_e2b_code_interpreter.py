"""The unmodified ``e2b_code_interpreter`` SDK against OpenDsec's ``code-interpreter-v1``
image, through the gateway: written as E2B user code (only the E2B variables are set).

The image is built by ``dsec setup --code-interpreter`` (pip downloads ~270 MB, so CI
builds it only with ``DSEC_CODE_INTERPRETER=1``); without it these tests skip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from dsec.edge.images.store import ImageStore
from dsec.interpreter.image import IMAGE
from dsec.testing.platform import RunningPlatform

pytest.importorskip("e2b_code_interpreter", reason="a dev dependency (pip install -e .[dev])")
from e2b_code_interpreter import Sandbox

pytestmark = [pytest.mark.platform, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def sbx(platform: RunningPlatform) -> Iterator[Sandbox]:
    if not ImageStore(platform.paths.images).has(IMAGE):
        pytest.skip(f"no {IMAGE} image: run `dsec setup --code-interpreter`")
    gateway = f"http://{platform.layout.gateway}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_URL", gateway)
        mp.setenv("E2B_SANDBOX_URL", gateway)
        mp.setenv("E2B_API_KEY", platform.admin_key)
        s = Sandbox.create(timeout=300)  # the SDK's default template: code-interpreter-v1
        try:
            yield s
        finally:
            s.kill()


def test_results_stdout_stderr_and_state(sbx: Sandbox) -> None:
    lines: list[str] = []
    ex = sbx.run_code(
        "import sys\nx = 6 * 7\nprint('hello')\nprint('oops', file=sys.stderr)\nx",
        on_stdout=lambda m: lines.append(m.line),
    )
    assert ex.error is None
    assert ex.text == "42"
    assert ex.logs.stdout == ["hello\n"]
    assert ex.logs.stderr == ["oops\n"]
    assert lines == ["hello\n"]
    assert sbx.run_code("x + 1").text == "43"  # the kernel keeps its state
    assert sbx.run_code("import os; os.environ['RUN_VAR']", envs={"RUN_VAR": "v"}).text == "'v'"


def test_errors_carry_the_traceback(sbx: Sandbox) -> None:
    ex = sbx.run_code("def f():\n    return 1 / 0\nf()")
    assert ex.error is not None
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    assert "ZeroDivisionError" in ex.error.traceback
    assert "f()" in ex.error.traceback


def test_contexts_are_separate_kernels(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context()
    try:
        sbx.run_code("only_here = 1", context=ctx)
        assert sbx.run_code("'only_here' in dir()", context=ctx).text == "True"
        assert sbx.run_code("'only_here' in dir()").text == "False"
        assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    finally:
        sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]


def test_matplotlib_png(sbx: Sandbox) -> None:
    ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1
    assert pngs[0].startswith("iVBORw0KGgo")  # base64 of the PNG signature


STREAMING_CELL = (
    "import sys, time\n"
    "print('first', flush=True)\n"
    "display('shown')\n"
    "print('warn', file=sys.stderr, flush=True)\n"
    "time.sleep(5)\n"
    "print('last')\n"
)


def test_output_streams_while_the_cell_runs(sbx: Sandbox) -> None:
    t0 = time.monotonic()
    at: dict[str, float] = {}

    def seen(what: str) -> None:
        at.setdefault(what, time.monotonic() - t0)

    ex = sbx.run_code(
        STREAMING_CELL,
        on_stdout=lambda m: seen(m.line.strip()),
        on_stderr=lambda m: seen("stderr:" + m.line.strip()),
        on_result=lambda r: seen("result"),
    )
    ended = time.monotonic() - t0
    assert ex.logs.stdout == ["first\n", "last\n"]
    assert set(at) == {"first", "result", "stderr:warn", "last"}
    for early in ("first", "result", "stderr:warn"):
        assert at[early] < ended - 2, (early, at, ended)  # well before the cell ended
    assert at["last"] > at["first"] + 2


def test_async_client_streams_too(sbx: Sandbox) -> None:
    from e2b_code_interpreter import AsyncSandbox

    async def main() -> tuple[dict[str, float], float]:
        a = await AsyncSandbox.connect(sbx.sandbox_id)
        t0 = time.monotonic()
        at: dict[str, float] = {}
        ex = await a.run_code(
            STREAMING_CELL, on_stdout=lambda m: at.setdefault(m.line.strip(), time.monotonic() - t0)
        )
        assert ex.error is None
        return at, time.monotonic() - t0

    at, ended = asyncio.run(main())
    assert at["first"] < ended - 2
    assert at["last"] > at["first"] + 2
