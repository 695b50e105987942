"""The ``container`` backend: crun containers on overlayfs, limited by cgroups and seccomp."""

from dsec.edge.backends.container.backend import ContainerBackend

__all__ = ["ContainerBackend"]
