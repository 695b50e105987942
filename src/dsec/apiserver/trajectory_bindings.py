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
"""

from __future__ import annotations

MAX_ENTRIES = 100_000


class Bindings:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._seen: dict[str, str] = {}  # sandbox -> trajectory id, "" for not bound
        self._distrust: set[str] = set()  # sandboxes whose "not bound" is not cached

    def tid(self, sandbox_id: str) -> str:
        """The trajectory the sandbox was last seen bound to ("" if none or not known)."""
        return self._seen.get(sandbox_id, "")

    def unbound(self, sandbox_id: str) -> bool:
        """Whether the sandbox was last seen bound to no trajectory."""
        return self._seen.get(sandbox_id) == ""

    def saw(self, sandbox_id: str, tid: str) -> None:
        if not tid and sandbox_id in self._distrust:
            self._seen.pop(sandbox_id, None)
            return
        if sandbox_id not in self._seen and len(self._seen) >= self.max_entries:
            del self._seen[next(iter(self._seen))]  # the oldest entry
        self._seen[sandbox_id] = tid

    def refused(self, sandbox_id: str) -> None:
        """The edge refused a call sent as unbound: the sandbox is marked bound."""
        self._seen.pop(sandbox_id, None)
        if len(self._distrust) >= self.max_entries:
            self._distrust.clear()
        self._distrust.add(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone, or its binding changed here."""
        self._seen.pop(sandbox_id, None)
        self._distrust.discard(sandbox_id)
