"""The edge daemon: final admission, sandbox lifecycle, re-adoption, runtime relay."""
