"""The ``container`` backend: crun containers on overlayfs, limited by cgroups and seccomp.

The backend class lives in :mod:`.backend`; this package imports nothing, so the function
pool can use its cgroup, mount and seccomp helpers without loading crun or networking code.
"""
