"""Which sandboxes are bound to a trajectory, as this apiserver last saw: so a runtime call
of an unbound sandbox costs no store read.

- bound (sandbox -> trajectory id): a hint. The call reads that trajectory's record anyway
  (to replay or record), and a record that no longer names the sandbox sends the lookup back
  to the store.
- not bound: cached, although another apiserver may bind the sandbox at any time. Such a
  call is sent with ``RuntimeCall.unbound`` set, and the sandbox's edge refuses it
  (``trajectory_bound``) once the sandbox is marked bound there (binding marks it before it
  answers); the apiserver then forgets the entry, looks the binding up and records the call.
  A sandbox the edge calls bound but the store does not (its trajectory was removed while the
  mark stayed) is never cached as not bound again.
- recording (sandbox -> its trajectory's record as this apiserver last wrote it, in record
  mode): a recorded call runs and appends from it without reading the store. The record is
  stale once another apiserver appended (the append's guard fails, it reads and retries: the
  numbering is the store's) or re-opened, rebound or removed the trajectory (the call must not
  run as recorded: it may have to be replayed). Each bind has a new epoch, marked at the edge
  before it is answered; such a call carries the epoch of its cached record
  (``RuntimeCall.trajectory_epoch``) and the edge refuses it (``trajectory_bound``) before it
  runs when the sandbox's mark differs; the apiserver then drops the record and looks it up.
"""

from __future__ import annotations

from dsec.store.api import KeyValue
from dsec.trajectory.records import Trajectory

MAX_ENTRIES = 100_000


class Bindings:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._seen: dict[str, str] = {}  # sandbox -> trajectory id, "" for not bound
        self._distrust: set[str] = set()  # sandboxes whose "not bound" is not cached
        self._records: dict[str, tuple[Trajectory, KeyValue]] = {}  # recording sandboxes

    def tid(self, sandbox_id: str) -> str:
        """The trajectory the sandbox was last seen bound to ("" if none or not known)."""
        return self._seen.get(sandbox_id, "")

    def unbound(self, sandbox_id: str) -> bool:
        """Whether the sandbox was last seen bound to no trajectory."""
        return self._seen.get(sandbox_id) == ""

    def recording(self, sandbox_id: str) -> tuple[Trajectory, KeyValue] | None:
        """The record a recording sandbox's trajectory had after this apiserver's last
        append (None: not known, or the binding was looked up since)."""
        return self._records.get(sandbox_id)

    def wrote(self, sandbox_id: str, t: Trajectory, kv: KeyValue) -> None:
        """This apiserver appended to the sandbox's trajectory; ``t``/``kv``: the record as
        written (kept only in record mode and with an epoch the edge can check)."""
        if t.mode != "record" or not t.epoch or self._seen.get(sandbox_id) != t.id:
            self._records.pop(sandbox_id, None)
            return
        if sandbox_id not in self._records and len(self._records) >= self.max_entries:
            del self._records[next(iter(self._records))]
        self._records[sandbox_id] = (t, kv)

    def stale(self, sandbox_id: str) -> None:
        """The edge refused a call sent from the cached record: the binding changed."""
        self._records.pop(sandbox_id, None)

    def saw(self, sandbox_id: str, tid: str) -> None:
        self._records.pop(sandbox_id, None)
        if not tid and sandbox_id in self._distrust:
            self._seen.pop(sandbox_id, None)
            return
        if sandbox_id not in self._seen and len(self._seen) >= self.max_entries:
            del self._seen[next(iter(self._seen))]  # the oldest entry
        self._seen[sandbox_id] = tid

    def refused(self, sandbox_id: str) -> None:
        """The edge refused a call sent as unbound: the sandbox is marked bound."""
        self._seen.pop(sandbox_id, None)
        self._records.pop(sandbox_id, None)
        if len(self._distrust) >= self.max_entries:
            self._distrust.clear()
        self._distrust.add(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone, or its binding changed here."""
        self._seen.pop(sandbox_id, None)
        self._records.pop(sandbox_id, None)
        self._distrust.discard(sandbox_id)
