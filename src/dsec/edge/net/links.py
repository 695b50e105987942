"""Network namespaces and veth pairs, made in-process with pyroute2 and a few syscalls.

A sandbox's namespace is made by a thread that ``unshare(CLONE_NEWNET)``s, configures it
(``lo`` up, ``eth0`` with the sandbox's addresses and default routes; IPv6 off unless the
edge has an IPv6 pool), creates
the veth pair with its host end in the gateway namespace, keeps the namespace alive with
a bind mount of its nsfs file, and returns to where it was. No subprocess is spawned.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace behind ``fd``."""
    _check(_libc.setns(fd, CLONE_NEWNET), "setns")


def open_netns(path: str | os.PathLike[str]) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def current_netns_fd() -> int:
    return os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)


@contextlib.contextmanager
def entered(fd: int) -> Iterator[None]:
    """Run the block with this thread in another network namespace, then come back."""
    back = current_netns_fd()
    try:
        setns(fd)
        try:
            yield
        finally:
            setns(back)
    finally:
        os.close(back)


def remove_netns(path: Path) -> None:
    """Unmount and delete a namespace file (no error if it is already gone)."""
    p = os.fsencode(path)
    if _libc.umount2(p, MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def make_sandbox_netns(
    path: Path,
    *,
    gateway_fd: int,
    host_ifname: str,
    address: str,
    gateway: str,
    prefixlen: int,
    address6: str = "",
    gateway6: str = "",
) -> None:
    """Create the namespace at ``path`` with ``eth0`` and the veth's host end in the gateway.
    With ``address6`` eth0 also gets that IPv6 address (/126) and a default route via
    ``gateway6``; without, IPv6 is off in the namespace.

    Runs on the calling thread and leaves it where it was. On failure the namespace is
    removed; the caller deletes ``host_ifname`` (it may exist).
    """
    back = current_netns_fd()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    os.close(fd)
    try:
        _check(_libc.unshare(CLONE_NEWNET), "unshare")
        try:
            src = f"/proc/self/task/{threading.get_native_id()}/ns/net".encode()
            _check(_libc.mount(src, os.fsencode(path), None, MS_BIND, None), "bind netns")
            _configure_inside(
                gateway_fd, host_ifname, address, gateway, prefixlen, address6, gateway6
            )
        finally:
            setns(back)
    except BaseException:
        remove_netns(path)
        raise
    finally:
        os.close(back)


IFA_F_NODAD = 0x02
PREFIXLEN6 = 126


def _sysctls6(address6: str) -> None:
    # IPv6 off, or on without router advertisements, autoconfiguration and DAD (the
    # addresses are ours alone; DAD would delay them by a second)
    values = {"disable_ipv6": "0", "accept_ra": "0", "autoconf": "0", "accept_dad": "0"}
    with contextlib.suppress(OSError):
        for conf in ("all", "default"):
            for name, value in values.items() if address6 else [("disable_ipv6", "1")]:
                with open(f"/proc/sys/net/ipv6/conf/{conf}/{name}", "w") as f:
                    f.write(value)


def _configure_inside(
    gateway_fd: int,
    host_ifname: str,
    address: str,
    gateway: str,
    prefixlen: int,
    address6: str,
    gateway6: str,
) -> None:
    _sysctls6(address6)
    with IPRoute() as ip:
        ip.link("set", index=1, state="up")
        ip.link(
            "add",
            ifname="eth0",
            kind="veth",
            peer={"ifname": host_ifname, "net_ns_fd": gateway_fd},
        )
        (idx,) = ip.link_lookup(ifname="eth0")
        ip.addr("add", index=idx, address=address, prefixlen=prefixlen)
        if address6:
            ip.addr("add", index=idx, address=address6, prefixlen=PREFIXLEN6, flags=IFA_F_NODAD)
        ip.link("set", index=idx, state="up")
        ip.route("add", dst="0.0.0.0/0", gateway=gateway)
        if address6:
            ip.route("add", dst="::/0", gateway=gateway6, family=socket.AF_INET6)


def configure_host_end(
    ip: IPRoute, ifname: str, address: str, prefixlen: int, address6: str = ""
) -> None:
    """Address and bring up the veth's host end (``ip`` lives in the gateway namespace)."""
    (idx,) = ip.link_lookup(ifname=ifname)
    ip.addr("add", index=idx, address=address, prefixlen=prefixlen)
    if address6:
        ip.addr("add", index=idx, address=address6, prefixlen=PREFIXLEN6, flags=IFA_F_NODAD)
    ip.link("set", index=idx, state="up")


def delete_link(ip: IPRoute, ifname: str) -> bool:
    """Delete a link by name; False if there was none."""
    found = ip.link_lookup(ifname=ifname)
    if not found:
        return False
    try:
        ip.link("del", index=found[0])
    except NetlinkError as exc:
        if exc.code != errno.ENODEV:
            raise
    return True


def link_names(ip: IPRoute, prefix: str) -> list[str]:
    """Names of the links in ``ip``'s namespace that start with ``prefix``."""
    names = []
    for link in ip.get_links():
        name = link.get_attr("IFLA_IFNAME")
        if isinstance(name, str) and name.startswith(prefix):
            names.append(name)
    return names


TAP = "tap0"  # the VMM's device inside a VM sandbox's namespace
BRIDGE = "br0"


def add_tap(netns: Path) -> None:
    """Turn a prepared sandbox namespace into a VM's: ``eth0`` loses its address to the
    guest and joins a bridge with a persistent TAP (``tap0``) the VMM opens, so the guest
    owns the sandbox's address on the same veth, firewall chains and sets as a container.

    Runs on the calling thread and leaves it where it was.
    """
    fd = open_netns(netns)
    try:
        with entered(fd), IPRoute() as ip:
            (eth,) = ip.link_lookup(ifname="eth0")
            ip.flush_addr(index=eth)  # its connected and default routes go with it
            ip.link("add", ifname=BRIDGE, kind="bridge")
            (br,) = ip.link_lookup(ifname=BRIDGE)
            ip.link("add", ifname=TAP, kind="tuntap", mode="tap")
            (tap,) = ip.link_lookup(ifname=TAP)
            for idx in (eth, tap):
                ip.link("set", index=idx, master=br)
            for idx in (br, tap, eth):
                ip.link("set", index=idx, state="up")
    finally:
        os.close(fd)
