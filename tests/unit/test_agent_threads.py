"""dsec.agent.threads: kept threads take the next job; busy ones do not hold a job up."""

from __future__ import annotations

import _thread
import threading
import time

from dsec.agent.threads import Pool


def _wait_idle(pool: Pool, n: int) -> None:
    deadline = time.monotonic() + 5
    while pool.idle != n:
        assert time.monotonic() < deadline, f"idle {pool.idle}, expected {n}"
        time.sleep(0.005)


def test_a_finished_thread_runs_the_next_job() -> None:
    pool = Pool(idle=4)
    seen: list[int] = []
    done = threading.Event()

    def note() -> None:
        seen.append(_thread.get_ident())
        if len(seen) == 2:
            done.set()

    pool.run(note)
    _wait_idle(pool, 1)
    pool.run(note)
    assert done.wait(5)
    assert len(seen) == 2
    assert seen[0] == seen[1]
    _wait_idle(pool, 1)


def test_busy_threads_do_not_delay_a_job_and_idle_ones_are_capped() -> None:
    pool = Pool(idle=2)
    release = threading.Event()
    started = threading.Semaphore(0)

    def block() -> None:
        started.release()
        release.wait(5)

    for _ in range(4):
        pool.run(block)
    for _ in range(4):  # all four run at once: none waited for another to end
        assert started.acquire(timeout=5)
    assert pool.idle == 0
    release.set()
    _wait_idle(pool, 2)  # two stay, the other two ended
    time.sleep(0.05)
    assert pool.idle == 2


def test_a_failing_job_does_not_end_the_thread() -> None:
    pool = Pool(idle=1)
    ran = threading.Event()

    def fail() -> None:
        raise ValueError("job failed")

    pool.run(fail)
    _wait_idle(pool, 1)
    pool.run(ran.set)
    assert ran.wait(5)
    _wait_idle(pool, 1)
