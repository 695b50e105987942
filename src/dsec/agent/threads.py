"""Threads that stay for the next job when theirs ends (vmport's channels in a microVM).

A thread per call or channel used to start and end with it: a clone, and at its end the
exit, the stack freed and the joiners woken, in the kernel and libc. In a microVM under
TCG a restored or forked guest translates all that code again for its first call (and
for the threads its snapshot caught ending); a kept thread just takes the next job. At
most ``IDLE`` threads wait; the others end as before.
"""

from __future__ import annotations

import _queue
import _thread
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

IDLE = 8  # threads kept waiting for a job


class Pool:
    def __init__(self, idle: int = IDLE) -> None:
        self.max_idle = idle
        self.jobs: Any = _queue.SimpleQueue()
        self.lock = _thread.allocate_lock()
        self.idle = 0

    def run(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` in a waiting thread, or in a new one when none waits."""
        with self.lock:
            if self.idle > 0:
                self.idle -= 1
                self.jobs.put((fn, args))
                return
        _thread.start_new_thread(self._work, (fn, args))

    def _work(self, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        while True:
            try:
                fn(*args)
            except Exception as exc:  # the job's own failure: this thread goes on
                try:
                    os.write(2, f"{type(exc).__name__}: {exc}\n".encode(errors="replace"))
                except OSError:
                    pass
            with self.lock:
                if self.idle >= self.max_idle:
                    return
                self.idle += 1
            fn, args = self.jobs.get()


run_in_thread = Pool().run
