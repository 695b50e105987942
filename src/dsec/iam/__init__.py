"""The iam daemon: API keys, projects with quotas, and atomic quota admission on SQLite.

* :mod:`dsec.iam.db` — the tables and every rule about them (no gRPC).
* :mod:`dsec.iam.keys` — API key generation and hashing.
* :mod:`dsec.iam.service` — the ``dsec.v1.Iam`` gRPC servicer.
* :mod:`dsec.iam.app` — wiring: PKI, database, bootstrap, server, metrics.

Run it with ``python -m dsec.iam --home H --listen 127.0.0.1:8421``.
"""
