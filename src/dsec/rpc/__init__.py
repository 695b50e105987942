"""The internal RPC layer: a local PKI, mTLS servers and channels, and error mapping.

* :mod:`dsec.rpc.tls` — CA and per-component certificates, credentials, ``ensure_edge_id``.
* :mod:`dsec.rpc.server` — ``make_server`` (mTLS + role authorization), ``peer_identity``.
* :mod:`dsec.rpc.client` — ``secure_channel`` whose unary calls raise DsecError.
* :mod:`dsec.rpc.errors` — the DsecError <-> gRPC status table.
* :mod:`dsec.rpc.kept_stream`, :mod:`dsec.rpc.stream_pump` — unary calls as messages of a
  kept stream: the calling end (unary fallback), the serving end.
* :mod:`dsec.rpc._gen` — code generated from ``protos/dsec.proto`` by ``scripts/gen-protos``.
"""
