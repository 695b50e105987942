"""One edge's sandbox networks: create, police, change and remove them; survive restarts.

All netlink and nftables work runs on one worker thread that lives in the gateway
namespace (so the firewall and host ends never depend on the caller's namespace). Each
sandbox has a small JSON record (address block, policy) written *before* anything is
made, so a failed create or a crash leaves enough to remove everything: :meth:`destroy`
deletes the host end, the nft objects that exist, the namespace file and the record.
After an edge restart :meth:`start` reloads the records and the networks carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from dsec.core.errors import (
    BackendUnavailable,
    DsecError,
    InvalidArgument,
    InvalidState,
    NodeFull,
    SandboxFailed,
    SandboxNotFound,
)
from dsec.core.netpolicy import NetworkPolicy
from dsec.edge.net import links, nlsets, ruleset
from dsec.edge.net.config import NetConfig
from dsec.edge.net.dns import Asker, DnsProxy
from dsec.edge.net.nftables import Nft
from dsec.obs import log

_log = logging.getLogger(__name__)
T = TypeVar("T")
PREFIXLEN = 30


@dataclass(frozen=True, slots=True)
class SandboxNet:
    """The network of one sandbox."""

    sandbox_id: str
    index: int
    key: str  # names its nft objects; host end is <if_prefix><key>
    address: str
    gateway: str
    netns: Path
    policy: NetworkPolicy
    tap: str = ""  # a VM sandbox's TAP device in ``netns`` (the guest owns ``address``)
    address6: str = ""  # "" when the edge has no IPv6 pool (and for VM guests: see add_tap)
    gateway6: str = ""

    def resolv_conf(self) -> str:
        return f"nameserver {self.gateway}\noptions timeout:2 attempts:2\n"

    def guest_mac(self) -> str:
        """A locally administered MAC derived from the address (stable across restores)."""
        return "52:54:" + ":".join(f"{int(b):02x}" for b in self.address.split("."))

    def kernel_ip_arg(self, device: str = "eth0") -> str:
        """The guest kernel's ``ip=`` argument (static address, gateway, DNS, no autoconf)."""
        mask = str(ipaddress.IPv4Network(f"0.0.0.0/{PREFIXLEN}").netmask)
        return f"ip={self.address}::{self.gateway}:{mask}::{device}:off:{self.gateway}"

    def to_json(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "index": self.index,
            "policy": self.policy.to_dict(),
            "tap": self.tap,
        }


class EdgeNetwork:
    def __init__(self, edge_id: str, config: NetConfig) -> None:
        self.edge_id = edge_id
        self.config = config
        self.table = ruleset.table_name(edge_id)
        digest = hashlib.sha256(edge_id.encode()).hexdigest()
        self.t = ruleset.TableSpec(
            family_table=f"inet {self.table}",
            if_prefix="dx" + digest[:4],
            pool=config.pool,
            dns_port=config.dns_port,
            pool6=config.pool6,
        )
        self._nets: dict[str, SandboxNet] = {}
        self._by_addr: dict[str, str] = {}
        self._resolved: dict[str, dict[str, tuple[str, float]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._nft: Nft | None = None
        self._sets: nlsets.SetWriter | None = None  # made in the gateway, used on the loop
        self._wsets: nlsets.SetWriter | None = None
        self._ip: IPRoute | None = None
        self._gw_fd = -1
        self._dns: DnsProxy | None = None
        self._lock = asyncio.Lock()
        self._warm: list[int] = []  # ready slots (see NetConfig.warm)
        self._making: set[int] = set()
        self._refill_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._stuck: set[int] = set()

    # ---- worker thread (lives in the gateway namespace) ---------------------------

    def _init_worker(self) -> None:
        links.setns(self._gw_fd)
        self._nft = Nft()
        # A netlink socket stays in the namespace it was made in, so the event loop can
        # write a sandbox's set elements through this one without a thread hop.
        self._sets = nlsets.SetWriter(self.table)
        self._wsets = nlsets.SetWriter(self.table)  # the worker's own
        self._ip = IPRoute()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            raise InvalidState("sandbox networking is not started")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _nft_run(self, text: str) -> str:
        assert self._nft is not None
        return self._nft.run(text)

    # ---- start / stop ---------------------------------------------------------------

    async def start(self) -> None:
        """Enter the gateway, make the table if missing, start the resolver, adopt records.

        Raises:
            BackendUnavailable: no libnftables, no gateway namespace, or forwarding off.
        """
        self._stopping = False
        cfg = self.config
        try:
            self._gw_fd = (
                links.open_netns(cfg.gateway_netns)
                if cfg.gateway_netns
                else links.current_netns_fd()
            )
        except OSError as exc:
            raise BackendUnavailable(f"gateway namespace {cfg.gateway_netns}: {exc}") from None
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="dsec-net", initializer=self._init_worker
        )
        cfg.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # No mount of its own: below the container backend's sandboxes dir (a shared
        # mount on hosts where crun runs in its own mount namespace) the namespace files
        # reach crun; elsewhere crun shares the edge's mount namespace.
        cfg.netns_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        try:
            listen, listen_tcp, upstream_sock = await self._run(self._setup_gateway)
        except OSError as exc:
            await self.close()
            raise BackendUnavailable(f"sandbox networking: {exc}") from None
        except DsecError:
            await self.close()
            raise
        self._dns = DnsProxy(
            listen=listen,
            listen_tcp=listen_tcp,
            upstream_sock=upstream_sock,
            upstream=cfg.upstream(),
            lookup=self._asker,
            on_answer=self._open_resolved,
            ipv6=bool(cfg.pool6),
        )
        await self._dns.start()
        for path in sorted(cfg.state_dir.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, DsecError):
                rec = json.loads(path.read_text())
                net = self._net_of(
                    rec["sandbox_id"], int(rec["index"]), NetworkPolicy.from_dict(rec["policy"])
                )
                self._remember(replace(net, tap=str(rec.get("tap", ""))))
        upgraded = await self._run(self._upgrade_slots)
        if upgraded:
            log(_log, "network slots upgraded", sandboxes=",".join(upgraded))
        await self._remove_orphans()
        self._refill()
        log(
            _log,
            "sandbox networking started",
            edge=self.edge_id,
            table=self.table,
            adopted=len(self._nets),
        )

    def _setup_gateway(self) -> tuple[socket.socket, socket.socket, socket.socket]:
        fwds = [(Path("/proc/sys/net/ipv4/ip_forward"), "net.ipv4.ip_forward")]
        if self.config.pool6:
            fwds.append(
                (Path("/proc/sys/net/ipv6/conf/all/forwarding"), "net.ipv6.conf.all.forwarding")
            )
        for fwd, name in fwds:
            if self.config.gateway_netns:
                fwd.write_text("1")  # namespace-local: the gateway is not the host's namespace
            elif fwd.read_text().strip() != "1":
                raise BackendUnavailable(f"sandbox networking needs {name}=1 on the host")
        assert self._nft is not None
        tables = self._nft.run("list tables")
        if f"table {self.t.family_table}\n" not in tables + "\n":
            self._nft.run(ruleset.base(self.t))
        else:
            self._nft.run(ruleset.ensure(self.t))
        listen = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        listen_tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listen.bind(("0.0.0.0", self.config.dns_port))
            listen_tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listen_tcp.bind(("0.0.0.0", self.config.dns_port))
            listen_tcp.listen(128)
            up.bind(("0.0.0.0", 0))
        except OSError:
            listen.close()
            listen_tcp.close()
            up.close()
            raise
        return listen, listen_tcp, up

    async def close(self) -> None:
        """Stop the resolver and the worker; sandbox networks stay (see :meth:`release`)."""
        await self._stop_refill()
        if self._dns is not None:
            await self._dns.close()
            self._dns = None
        if self._pool is not None:
            pool, self._pool = self._pool, None

            def fin() -> None:
                if self._ip is not None:
                    self._ip.close()
                if self._nft is not None:
                    self._nft.close()
                for writer in (self._sets, self._wsets):
                    if writer is not None:
                        writer.close()

            await asyncio.get_running_loop().run_in_executor(pool, fin)
            pool.shutdown()
        if self._gw_fd >= 0:
            os.close(self._gw_fd)
            self._gw_fd = -1

    async def release(self) -> None:
        """Delete the edge's table (only when no sandbox network is left), then close."""
        if self._nets:
            raise InvalidState(f"{len(self._nets)} sandbox networks still exist")
        await self._stop_refill()
        while self._warm:
            index = self._warm.pop()
            await self._run(self._unmake_slot, f"{index:x}", self._slot_netns(index))
        with contextlib.suppress(DsecError):
            await self._run(lambda: self._nft_run(f"delete table {self.t.family_table}"))
        await self.close()
        with contextlib.suppress(OSError):
            self.config.netns_dir.rmdir()

    # ---- sandboxes ------------------------------------------------------------------

    def _net_of(self, sandbox_id: str, index: int, policy: NetworkPolicy) -> SandboxNet:
        gw, addr = self.config.addresses(index)
        gw6, addr6 = self.config.addresses6(index)
        netns = self.config.netns_dir / f"n{index:x}"
        return SandboxNet(
            sandbox_id, index, f"{index:x}", addr, gw, netns, policy, address6=addr6, gateway6=gw6
        )

    def _remember(self, net: SandboxNet) -> None:
        self._nets[net.sandbox_id] = net
        self._by_addr[net.address] = net.sandbox_id
        if net.address6:
            self._by_addr[net.address6] = net.sandbox_id

    def _record(self, net: SandboxNet) -> Path:
        return self.config.state_dir / f"{net.sandbox_id}.json"

    def _save(self, net: SandboxNet) -> None:
        path = self._record(net)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(net.to_json()))
        os.replace(tmp, path)

    def get(self, sandbox_id: str) -> SandboxNet | None:
        return self._nets.get(sandbox_id)

    def ifname(self, net: SandboxNet) -> str:
        return self.t.if_prefix + net.key

    async def create(
        self, sandbox_id: str, policy: NetworkPolicy, *, tap: bool = False
    ) -> SandboxNet:
        """Make the sandbox's namespace, veth, addresses and firewall (or return the
        existing one after a restart). On failure nothing is left.

        ``tap``: for a VM: the same slot, then :func:`links.add_tap` hands the address to
        the guest behind a TAP in the namespace (the VMM runs in that namespace).

        Raises:
            NodeFull: the address pool is exhausted.
            SandboxFailed: netlink or nftables failed.
        """
        self._check_families(policy)
        async with self._lock:
            if sandbox_id in self._nets:
                return self._nets[sandbox_id]
            warm = bool(self._warm)
            index = self._warm.pop(0) if warm else self._free_index()
            net = self._net_of(sandbox_id, index, policy)
            if tap:
                net = replace(net, tap=links.TAP)
            # remembered first: the refill loop must not pick this index during the save
            self._remember(net)
            try:
                if warm:  # a few hundred bytes: cheaper here than a hop to a thread
                    self._save(net)
                else:
                    await asyncio.to_thread(self._save, net)
            except BaseException:
                self._nets.pop(sandbox_id, None)
                self._by_addr.pop(net.address, None)
                self._by_addr.pop(net.address6, None)
                if warm:
                    self._warm.insert(0, index)
                raise
        try:
            if not warm:
                await self._run(self._make_slot, index)
            self._attach_here(net)
            if tap:
                await self._run(links.add_tap, net.netns)
            self._refill()
        except BaseException as exc:
            await asyncio.shield(self.destroy(sandbox_id))
            if isinstance(exc, OSError | NetlinkError):
                raise SandboxFailed(f"network of sandbox {sandbox_id}: {exc}") from None
            raise
        return net

    def _attach_here(self, net: SandboxNet) -> None:
        """Fill a slot's sets from the event loop: one netlink batch (nothing for an empty
        policy); the slot's chains already deny everything."""
        self._write_sets(ruleset.policy_ops(net.key, net.policy, self.t.pool, self.t.pool6))

    def _write_sets(self, ops: list[nlsets.Op]) -> None:
        """Raises: InvalidArgument (overlapping port rules), SandboxFailed (the kernel's
        reason); nothing of ``ops`` applied either way."""
        if self._sets is None:
            raise InvalidState("sandbox networking is not started")
        try:
            self._sets.apply(ops)
        except FileExistsError:
            raise InvalidArgument(
                "port rules overlap partly (the same ports of overlapping networks): "
                "write them as non-overlapping rules"
            ) from None
        except OSError as exc:
            raise SandboxFailed(f"network rules refused by the kernel: {exc.strerror}") from None

    def _check_families(self, policy: NetworkPolicy) -> None:
        """Raises: InvalidArgument: IPv6 rules on an edge whose sandboxes have no IPv6."""
        if self.t.pool6:
            return
        rules = policy.cidrs("allow") + policy.cidrs("deny") + policy.ingress()
        v6 = [r.network for r in rules if ruleset.is_v6(r)]
        if v6:
            raise InvalidArgument(
                f"IPv6 rule {v6[0]}: this edge gives sandboxes no IPv6 address (--net-pool6)"
            )

    def _free_index(self) -> int:
        used = {n.index for n in self._nets.values()} | set(self._warm) | self._making
        used |= self._stuck
        index = next((i for i in range(1, self.config.capacity() + 1) if i not in used), 0)
        if not index:
            raise NodeFull("the edge's sandbox address pool is exhausted")
        return index

    def _slot_netns(self, index: int) -> Path:
        return self.config.netns_dir / f"n{index:x}"

    def _make_slot(self, index: int) -> None:
        """Namespace, veth, addresses, route and nft chains of slot ``index`` (blocking)."""
        assert self._ip is not None
        gw, addr = self.config.addresses(index)
        gw6, addr6 = self.config.addresses6(index)
        ifname = self.t.if_prefix + f"{index:x}"
        links.make_sandbox_netns(
            self._slot_netns(index),
            gateway_fd=self._gw_fd,
            host_ifname=ifname,
            address=addr,
            gateway=gw,
            prefixlen=PREFIXLEN,
            address6=addr6,
            gateway6=gw6,
        )
        links.configure_host_end(self._ip, ifname, gw, PREFIXLEN, gw6)
        key = f"{index:x}"
        self._nft_run(ruleset.add_slot(self.t, key, addr, addr6, dispatch=False))
        assert self._wsets is not None
        self._wsets.apply(ruleset.dispatch_ops(self.t, key))

    async def _stop_refill(self) -> None:
        # Not cancelled: a slot half-made on the worker would be lost; let it finish.
        self._stopping = True
        if self._refill_task is not None:
            with contextlib.suppress(DsecError, OSError):
                await self._refill_task
            self._refill_task = None

    def _refill(self) -> None:
        """Top up the warm slots in the background (one at a time, on the worker)."""
        if self._stopping or self.config.warm <= 0:
            return
        if self._refill_task and not self._refill_task.done():
            return
        self._refill_task = asyncio.create_task(self._refill_loop())

    async def _refill_loop(self) -> None:
        while not self._stopping and len(self._warm) + len(self._making) < self.config.warm:
            try:
                index = self._free_index()
            except NodeFull:
                return
            self._making.add(index)
            try:
                await self._run(self._make_slot, index)
            except (DsecError, OSError, NetlinkError) as exc:
                log(_log, "warm network failed", logging.WARNING, err=repr(exc))
                await self._run(self._unmake_slot, f"{index:x}", self._slot_netns(index))
                return
            finally:
                self._making.discard(index)
            self._warm.append(index)

    async def _remove_orphans(self) -> None:
        """Remove slots no sandbox record names (warm ones of a previous run, or debris)."""
        owned = {n.key for n in self._nets.values()}
        keys = {p.name[1:] for p in self.config.netns_dir.glob("n*")}
        assert self._ip is not None
        names = await self._run(lambda: links.link_names(self._ip, self.t.if_prefix))
        keys |= {n[len(self.t.if_prefix) :] for n in names}
        for key in sorted(keys - owned):
            if re.fullmatch(r"[0-9a-f]{1,5}", key):
                path = self.config.netns_dir / f"n{key}"
                try:
                    await self._run(self._unmake_slot, key, path)
                except DsecError as exc:  # never keep the edge from starting over debris
                    log(_log, "orphan network slot left", logging.WARNING, err=exc.message)
                    self._stuck.add(int(key, 16))  # its address block is not reused

    async def destroy(self, sandbox_id: str) -> None:
        """Remove the sandbox's network; idempotent, also for half-made ones.

        Raises:
            SandboxFailed: something could not be removed.
        """
        net = self._nets.get(sandbox_id)
        if net is None:
            return
        await self._run(lambda: self._unmake(net))
        self._nets.pop(sandbox_id, None)
        self._by_addr.pop(net.address, None)
        self._by_addr.pop(net.address6, None)
        self._resolved.pop(sandbox_id, None)
        with contextlib.suppress(FileNotFoundError):
            self._record(net).unlink()

    def _unmake(self, net: SandboxNet) -> None:
        self._unmake_slot(net.key, net.netns)

    def _unmake_slot(self, key: str, netns: Path) -> None:
        assert self._ip is not None
        assert self._wsets is not None
        ops = ruleset.dispatch_ops(self.t, key, delete=True)
        try:
            try:
                self._wsets.apply(ops)
            except FileNotFoundError:  # some are missing (a half-made slot): the others
                for op in ops:
                    with contextlib.suppress(FileNotFoundError):
                        self._wsets.apply([op])
        except OSError as exc:
            raise SandboxFailed(f"removing network slot {key}: {exc}") from None
        try:
            self._nft_run(ruleset.remove_sandbox(self.t, key, maps=False))
        except SandboxFailed:
            self._nft_run(ruleset.remove_sandbox(self.t, key, self._present(key), maps=False))
        try:
            links.delete_link(self._ip, self.t.if_prefix + key)
            links.remove_netns(netns)
        except (OSError, NetlinkError) as exc:
            raise SandboxFailed(f"removing network slot {key}: {exc}") from None

    def _present(self, key: str) -> set[str]:
        """Names of this sandbox's nft objects and map keys that exist."""
        ifname = self.t.if_prefix + key
        return {
            n
            for n in self._table_names()
            if (n.endswith(f"_{key}") and ":" not in n) or n.endswith(f":{ifname}")
        }

    def _table_names(self) -> set[str]:
        """The table's chain, set and counter names and ``map:ifname`` dispatch keys."""
        assert self._nft is not None
        data = self._nft.json(f"list table {self.t.family_table}")
        names: set[str] = set()
        for item in data.get("nftables", []):
            for kind in ("chain", "set", "counter"):
                if kind in item:
                    names.add(item[kind].get("name", ""))
            m = item.get("map")
            if m and m.get("name") in ("egress", "ingress", "peer_in"):
                for elem in m.get("elem", []):
                    if isinstance(elem, list) and elem and isinstance(elem[0], str):
                        names.add(f"{m['name']}:{elem[0]}")
        return names

    def _upgrade_slots(self) -> list[str]:
        """Bring the adopted sandboxes' slots that an older edge made (objects missing,
        e.g. the ingress sets) up to the current layout, each in one transaction."""
        if not self._nets:
            return []
        names = self._table_names()
        done = []
        for net in list(self._nets.values()):
            if not ruleset.slot_objects(self.t, net.key) <= names:
                text = ruleset.upgrade_slot(self.t, net.key, net.address, net.policy, net.address6)
                self._nft_run(text)
                done.append(net.sandbox_id)
        return done

    async def set_policy(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxNet:
        """Replace the policy in one netlink batch (established flows that stay allowed
        keep going; addresses of names that stay allowed stay open for their TTL).

        Raises:
            SandboxNotFound: the sandbox has no network here.
        """
        net = self._nets.get(sandbox_id)
        if net is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} has no network on this edge")
        now = time.monotonic()
        keep = [
            (ip, int(exp - now))
            for ip, (name, exp) in self._resolved.get(sandbox_id, {}).items()
            if exp - now >= 1 and policy.name_allowed(name)
        ]
        new = replace(net, policy=policy)
        self._check_families(policy)
        ops = ruleset.policy_ops(net.key, policy, self.t.pool, self.t.pool6, flush=True)
        for name, v6 in ((f"dns_{net.key}", False), (f"dns6_{net.key}", True)):
            kept = [(ip, ttl) for ip, ttl in keep if (":" in ip) == v6]
            ops.append(nlsets.Op(name, nlsets.timeout_elements(kept)))
        self._write_sets(ops)
        self._nets[sandbox_id] = new
        await asyncio.to_thread(self._save, new)
        return new

    async def counters(self) -> dict[str, dict[str, int]]:
        """Per sandbox: allowed/denied bytes, packets and new connections."""
        data = await self._run(lambda: self._nft_json(f"list counters table {self.t.family_table}"))
        raw: dict[str, tuple[int, int]] = {}
        for item in data.get("nftables", []):
            c = item.get("counter")
            if c:
                raw[c["name"]] = (int(c.get("packets", 0)), int(c.get("bytes", 0)))
        out = {}
        for sid, net in self._nets.items():
            k = net.key
            out[sid] = {
                "allowed_bytes": raw.get(f"ok_{k}", (0, 0))[1],
                "allowed_packets": raw.get(f"ok_{k}", (0, 0))[0],
                "denied_bytes": raw.get(f"deny_{k}", (0, 0))[1],
                "denied_packets": raw.get(f"deny_{k}", (0, 0))[0],
                "allowed_connections": raw.get(f"new_ok_{k}", (0, 0))[0],
                "denied_connections": raw.get(f"new_deny_{k}", (0, 0))[0],
            }
        return out

    def _nft_json(self, cmd: str) -> dict[str, Any]:
        assert self._nft is not None
        return self._nft.json(cmd)

    # ---- resolver hooks -------------------------------------------------------------

    def _asker(self, address: str) -> Asker | None:
        sid = self._by_addr.get(address)
        net = self._nets.get(sid) if sid else None
        return Asker(net.sandbox_id, net.policy) if net else None

    async def _open_resolved(
        self, sandbox_id: str, name: str, addrs: list[tuple[str, int]]
    ) -> None:
        net = self._nets.get(sandbox_id)
        if net is None:
            raise SandboxNotFound(sandbox_id)
        # a name resolving to another sandbox opens nothing: peers need a CIDR rule
        addrs = [
            (ip, ttl) for ip, ttl in addrs if not ruleset.in_pool(ip, self.t.pool, self.t.pool6)
        ]
        if not addrs:
            return
        # "add" keeps an existing element's older timeout; a slightly longer first TTL is
        # harmless, and delete-then-add would race with the connect.
        v4 = [(ip, ttl) for ip, ttl in addrs if ":" not in ip]
        v6 = [(ip, ttl) for ip, ttl in addrs if ":" in ip]
        self._write_sets(
            [
                nlsets.Op(f"dns_{net.key}", nlsets.timeout_elements(v4)),
                nlsets.Op(f"dns6_{net.key}", nlsets.timeout_elements(v6)),
            ]
        )
        now = time.monotonic()
        seen = self._resolved.setdefault(sandbox_id, {})
        for ip, ttl in addrs:
            seen[ip] = (name, now + ttl)

    # ---- leak checks ----------------------------------------------------------------

    def leaked_files(self, sandbox_id: str) -> list[str]:
        """The record and namespace file of a sandbox, if left (blocking, no nft)."""
        found = []
        rec = self.config.state_dir / f"{sandbox_id}.json"
        if rec.exists():
            found.append(f"network record {rec}")
        net = self._nets.get(sandbox_id)
        if net is not None:
            found.append(f"network of {sandbox_id} (netns {net.netns})")
        return found

    async def leaked(self, sandbox_id: str, key: str | None = None) -> list[str]:
        """What is left of a sandbox's network (record, namespace file, nft objects)."""
        found = self.leaked_files(sandbox_id)
        if key is not None:
            names = await self._run(lambda: self._present(key))
            found += [f"nft {n}" for n in sorted(names)]
            assert self._ip is not None
            if await self._run(lambda: links.link_names(self._ip, self.t.if_prefix + key)):
                found.append(f"link {self.t.if_prefix + key}")
        return found
