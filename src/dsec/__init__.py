"""OpenDsec: a self-hosted sandbox platform for agentic RL and code execution.

The public entry points are the SDK (``dsec.sdk``) and the ``dsec`` command.
"""

__version__ = "0.1.0"
