"""The watcher daemon: the latest heartbeat of every edge and whether it is still healthy.

* :mod:`dsec.watcher.registry` — the edge view and health rule (no gRPC, clock injected).
* :mod:`dsec.watcher.service` — the ``dsec.v1.Watcher`` gRPC servicer.
* :mod:`dsec.watcher.app` — wiring: PKI, saved view, server, sweeps, metrics.

Run it with ``python -m dsec.watcher --home H --listen 127.0.0.1:8422``.
"""
