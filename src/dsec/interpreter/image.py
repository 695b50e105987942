"""Build the ``code-interpreter-v1`` image (``dsec setup --code-interpreter``).

The Python packages (``ipykernel``, ``jupyter_client``, ``matplotlib``) are installed on
the host with ``pip install --target`` through pip's own configuration (its index, no
host named here), then copied into the image's ``/usr/local/lib/python3.11/dist-packages``
with the Dockerfile build: sandboxes have no network by default, so a RUN could not reach
an index. The wheels must match the base image's Python (Debian bookworm's 3.11), so the
host pip must run on 3.11 too. The image's Entrypoint starts :mod:`dsec.interpreter.server`
on port 49999; the name is E2B's default template of ``e2b_code_interpreter.Sandbox``.

The Dockerfile has no RUN, so the build needs no sandbox and no running platform: it runs
here, straight into the image store, with the step cache (a second setup is ``CACHED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from dsec.core.errors import Internal, Unavailable
from dsec.edge.images.build import Builder, BuildEvent, BuildOptions, RunResult
from dsec.edge.images.store import Image, ImageStore

IMAGE = "code-interpreter-v1"
PORT = 49999
PACKAGES = ("ipykernel", "jupyter_client", "matplotlib")
PYTHON = (3, 11)  # the base image's python3
DOCKERFILE = f"""\
FROM base
COPY site/ /usr/local/lib/python3.11/dist-packages/
COPY server.py /opt/dsec-interpreter/server.py
ENV MPLBACKEND=module://matplotlib_inline.backend_inline
WORKDIR /root
ENTRYPOINT ["python3", "/opt/dsec-interpreter/server.py", "--port", "{PORT}"]
"""
SERVER = Path(__file__).resolve().parent / "server.py"

Progress = Callable[[str], None]


def install_packages(site: Path, packages: Sequence[str], progress: Progress) -> None:
    """``pip install --target site`` once per package list (a stamp remembers it).

    Raises:
        Unavailable: the host Python is not 3.11, or pip failed (its output says why).
    """
    if sys.version_info[:2] != PYTHON:
        raise Unavailable(
            f"the code-interpreter packages must be installed by Python "
            f"{PYTHON[0]}.{PYTHON[1]} (the base image's), not {sys.version.split()[0]}"
        )
    stamp = site.parent / "site.stamp"
    want = hashlib.sha256("\n".join(sorted(packages)).encode()).hexdigest()
    if site.is_dir() and stamp.is_file() and stamp.read_text().strip() == want:
        return
    progress(f"pip install --target {site} {' '.join(packages)}")
    tmp = site.with_name(site.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--target", str(tmp), *packages],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise Unavailable(f"pip could not install {', '.join(packages)}: {tail}")
    shutil.rmtree(tmp / "bin", ignore_errors=True)  # scripts name the host's interpreter
    shutil.rmtree(site, ignore_errors=True)
    tmp.rename(site)
    stamp.write_text(want + "\n")


def prepare_context(work: Path, packages: Sequence[str], progress: Progress) -> Path:
    """The build context: the packages, the server and the Dockerfile."""
    context = work / "context"
    context.mkdir(parents=True, exist_ok=True)
    install_packages(context / "site", packages, progress)
    shutil.copyfile(SERVER, context / "server.py")
    (context / "Dockerfile").write_text(DOCKERFILE)
    return context


@contextlib.asynccontextmanager
async def _no_sandbox(*_: object) -> AsyncIterator[tuple[RunResult, Path]]:
    raise Internal("the code-interpreter Dockerfile has no RUN step")
    yield  # pragma: no cover


async def _build(store: ImageStore, context: Path, tag: str, progress: Progress) -> Image:
    image: Image | None = None
    async for ev in Builder(store, _no_sandbox).build(context, BuildOptions(tag=tag)):
        if isinstance(ev, BuildEvent):
            step = ev.kind == "step"
            progress(f"Step {ev.index}/{ev.total} : {ev.text}" if step else f" ---> {ev.text}")
        else:
            image = ev
    assert image is not None
    return image


def build_image(
    store: ImageStore,
    work: Path,
    *,
    tag: str = IMAGE,
    packages: Sequence[str] = PACKAGES,
    progress: Progress = lambda _: None,
) -> Image:
    """Install the packages (cached under ``work``) and build ``tag`` into ``store``."""
    context = prepare_context(work, packages, progress)
    return asyncio.run(_build(store, context, tag, progress))
