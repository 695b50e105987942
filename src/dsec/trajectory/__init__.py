"""The global trajectory log: every runtime call of a bound sandbox is a numbered step
(request + result), recorded in the cluster's store before the result is returned, and
replayed instead of re-run when a preempted task starts again from the top.

- :mod:`.canon`: the canonical form of a request, and what differs between two,
- :mod:`.blobs`: content-addressed storage for payloads too large for the store,
- :mod:`.log`: the log itself, on any :class:`~dsec.store.StateStore`,
- :mod:`.retention`: the sweeper (age and size limits).
"""
