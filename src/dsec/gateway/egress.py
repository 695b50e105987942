"""E2B egress settings (``allowOut``/``denyOut``/``allowInternetAccess``) as an OpenDsec
network policy (``{"allow": [...], "deny": [...]}``).

The two models differ: E2B is open by default and an ``allowOut`` entry wins over a
``denyOut`` one (it punches a hole in a deny); OpenDsec denies by default and a deny rule
wins. So:

- ``denyOut`` holding ``0.0.0.0/0`` (or ``allowInternetAccess: false``): only ``allowOut``
  is reachable -> ``allow = allowOut``;
- otherwise everything but ``denyOut`` is reachable -> ``allow = [0.0.0.0/0]``,
  ``deny = denyOut``; an ``allowOut`` address inside a denied network cannot be said in
  OpenDsec's model and is refused, one outside is already open and is dropped;
- neither field: the open internet (``allow = [0.0.0.0/0]``).

E2B's egress proxy, per-host transform rules, DNS servers, host masking and public-traffic
switch have no OpenDsec counterpart and are refused when set.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from dsec.core.errors import InvalidArgument

ALL_TRAFFIC = "0.0.0.0/0"
UNSUPPORTED = ("egressProxy", "rules", "dnsServers", "maskRequestHost", "httpsPorts")


def _rules(body: dict[str, Any], key: str) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"network.{key} must be a list of strings")
    return value


def _net(rule: str) -> ipaddress.IPv4Network | None:
    try:
        net = ipaddress.ip_network(rule, strict=False)
    except ValueError:
        return None  # a domain
    return net if isinstance(net, ipaddress.IPv4Network) else None


def policy(network: dict[str, Any] | None, allow_internet: bool | None) -> dict[str, list[str]]:
    """The OpenDsec policy of an E2B ``network`` object and ``allow_internet_access`` flag."""
    network = network or {}
    if not isinstance(network, dict):
        raise InvalidArgument("'network' must be an object")
    for key in UNSUPPORTED:
        if network.get(key) not in (None, [], {}):
            raise InvalidArgument(f"network.{key} is not supported by the OpenDsec gateway")
    if network.get("allowPublicTraffic") is True:
        raise InvalidArgument(
            "network.allowPublicTraffic is not supported: OpenDsec sandbox ports need the "
            "sandbox's traffic access token"
        )
    allow, deny = _rules(network, "allowOut"), _rules(network, "denyOut")
    if allow_internet is False or ALL_TRAFFIC in deny:
        return {"allow": allow, "deny": []}
    denied = [n for n in map(_net, deny) if n is not None]
    for rule in allow:
        net = _net(rule)
        if net is not None and any(net.overlaps(d) for d in denied):
            raise InvalidArgument(
                f"network.allowOut {rule!r} reopens part of a denyOut network; OpenDsec rules "
                f"cannot say that (deny wins) unless denyOut holds {ALL_TRAFFIC}"
            )
    return {"allow": [ALL_TRAFFIC], "deny": deny}
