"""The control plane's state store: one interface (:mod:`.api`), three backends.

- :class:`~dsec.store.memory.MemoryStore` for unit tests,
- :class:`~dsec.store.sqlite.SqliteStore`, the embedded single-node default,
- :class:`~dsec.store.etcd.EtcdStore`, an etcd v3 cluster (our own grpc.aio client),

and :mod:`.admission`, atomic quota admission on top of any of them.
"""

from .api import (
    MAX_TXN_OPS,
    MAX_VALUE_BYTES,
    Compare,
    Delete,
    Event,
    EventType,
    KeyValue,
    Op,
    Put,
    RangeResult,
    StateStore,
    Target,
    TxnResult,
    WatchBatch,
    prefix_end,
)

__all__ = [
    "MAX_TXN_OPS",
    "MAX_VALUE_BYTES",
    "Compare",
    "Delete",
    "Event",
    "EventType",
    "KeyValue",
    "Op",
    "Put",
    "RangeResult",
    "StateStore",
    "Target",
    "TxnResult",
    "WatchBatch",
    "prefix_end",
]
