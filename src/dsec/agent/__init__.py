"""The in-sandbox side: aether (runtime API server) and chronus (process and shell host).

Modules here import only the standard library: they run from the self-contained agent
bundle inside images that may have no Python of their own. The exceptions run on the host
and are not shipped: ``bundle`` (builds the bundle) and ``local`` (runs aether outside a
container, for tests).
"""
