"""Execution backends behind one interface (``dsec.edge.backends.api.Backend``)."""
