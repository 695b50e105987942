"""E2B-compatible gateway: existing E2B SDK code runs unchanged against OpenDsec.

It speaks E2B's control-plane REST API and envd's Connect/HTTP API on one address and
translates every call to OpenDsec's public HTTP API and runtime WebSocket, as a client
with the caller's API key. See ``app.py`` for how requests are routed.
"""
