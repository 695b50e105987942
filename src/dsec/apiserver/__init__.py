"""The apiserver: the public HTTP/JSON + WebSocket API. Stateless: it authenticates, asks
iam to admit, picks an edge from the watcher's view and forwards."""
