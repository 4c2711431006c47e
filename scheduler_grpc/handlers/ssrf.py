"""SSRF guard for `http.webhook`: which addresses a job may make the worker connect to.

Rules:

- Every address a host resolves to must be globally routable, or inside an allow-listed network.
  One bad address refuses the host (a name resolving to a public and a private address is how
  DNS rebinding and split-horizon tricks get in).
- IPv4-mapped IPv6 (`::ffff:a.b.c.d`) is judged as the IPv4 address it is; 6to4 (`2002::/16`) and
  NAT64 (`64:ff9b::/96`) by the IPv4 address they embed; the other transition ranges are refused.
- Literal hosts are parsed the way libc parses them (`inet_aton`: `0177.0.0.1`, `2130706433`,
  `0x7f.1`, `127.1` are all 127.0.0.1), not the way `ipaddress` does, so odd spellings cannot slip
  past the check and still be connected to.
- The connection goes to the vetted address: `VettingResolver` is the only resolver of the
  webhook's connector, so there is no second lookup that could be rebound.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Awaitable, Callable, Iterable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from typing import Any, TypeAlias

from aiohttp.abc import AbstractResolver, ResolveResult

IPAddress: TypeAlias = IPv4Address | IPv6Address
Network: TypeAlias = IPv4Network | IPv6Network
AddrInfo: TypeAlias = tuple[int, int, int, str, tuple[Any, ...]]
GetAddrInfo: TypeAlias = Callable[[str, int, int], Awaitable[list[AddrInfo]]]

_IPV4_LIKE = re.compile(r"^[0-9a-fA-FxX.]+$")

_DENIED: tuple[tuple[Network, str], ...] = tuple(
    (ip_network(cidr), reason)
    for cidr, reason in (
        ("0.0.0.0/8", "unspecified ('this network')"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "carrier-grade NAT (shared address space)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local (cloud metadata lives here)"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::/96", "IPv4-compatible (deprecated)"),
        ("::ffff:0:0:0/96", "IPv4-translated"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/23", "IETF protocol assignments (incl. Teredo)"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "segment routing (reserved)"),
        ("fc00::/7", "unique local (private)"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("ff00::/8", "multicast"),
    )
)
_NAT64 = ip_network("64:ff9b::/96")
_SIX_TO_FOUR = ip_network("2002::/16")


class TargetRefused(Exception):
    """A webhook target resolves to an address it may not reach.

    Attributes:
        host: the host of the URL.
        address: the refused address.
        reason: why (e.g. `loopback`).
    """

    def __init__(self, host: str, address: IPAddress, reason: str) -> None:
        shown = host if host == str(address) else f"{host} ({address})"
        super().__init__(
            f"refusing to connect to {shown}: {reason} address; only globally routable addresses or "
            "SCHEDULER_WEBHOOK_ALLOWLIST networks may be reached"
        )
        self.host = host
        self.address = address
        self.reason = reason


def parse_literal_host(host: str) -> IPAddress | None:
    """The address a URL host denotes when it is a literal, as libc would read it; else None.

    IPv6 literals come without brackets (`::1`, zone ids allowed). IPv4 literals may use any form
    `inet_aton` accepts: decimal, octal or hex parts, one to four of them.

    Raises:
        ValueError: the host contains `:` but is not an IPv6 address.
    """
    text = host.strip()
    if ":" in text:
        return ip_address(text.split("%", 1)[0].strip("[]"))
    candidate = text[:-1] if text.endswith(".") else text
    if not candidate or not _IPV4_LIKE.match(candidate):
        return None
    try:
        return IPv4Address(socket.inet_aton(candidate))
    except OSError:
        return None


def in_networks(address: IPAddress, networks: Iterable[Network]) -> bool:
    """Whether `address` lies in one of `networks` (families compared like with like)."""
    return any(address.version == network.version and address in network for network in networks)


def refusal_reason(address: IPAddress, allowlist: Iterable[Network] = ()) -> str | None:
    """Why `address` may not be connected to, or None when it may.

    Args:
        address: a resolved or literal address.
        allowlist: networks allowed although they are not globally routable.
    """
    allowlist = tuple(allowlist)
    if isinstance(address, IPv6Address):
        if address.scope_id is not None:
            address = IPv6Address(str(address).split("%", 1)[0])
        mapped = address.ipv4_mapped
        if mapped is not None:  # the same endpoint as the IPv4 address
            return refusal_reason(mapped, allowlist)
    if in_networks(address, allowlist):
        return None
    if isinstance(address, IPv6Address):
        embedded: IPv4Address | None = None
        if address in _SIX_TO_FOUR:
            embedded = address.sixtofour
        elif address in _NAT64:
            embedded = IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            reason = refusal_reason(embedded)
            return None if reason is None else f"{reason} (embedded IPv4 {embedded})"
    for network, reason in _DENIED:
        if address.version == network.version and address in network:
            return reason
    if not address.is_global:
        return "not globally routable"
    return None


def vet(host: str, address: IPAddress, allowlist: Iterable[Network] = ()) -> None:
    """Refuse `address` (the resolution of `host`) unless it may be connected to.

    Raises:
        TargetRefused: naming the host, the address and the reason.
    """
    reason = refusal_reason(address, allowlist)
    if reason is not None:
        raise TargetRefused(host, address, reason)


class VettingResolver(AbstractResolver):
    """An aiohttp resolver that returns only vetted addresses, and refuses a host with any bad one.

    aiohttp connects to the addresses it returns and keeps the host name for TLS (SNI and
    certificate checks), so what is vetted is what is connected to.

    Args:
        allowlist: networks allowed although they are not globally routable.
        getaddrinfo: the lookup (default: the running loop's `getaddrinfo`, run off the loop);
            tests pass a fake one.
    """

    def __init__(self, allowlist: Iterable[Network] = (), getaddrinfo: GetAddrInfo | None = None) -> None:
        self.allowlist = tuple(allowlist)
        self._getaddrinfo = getaddrinfo

    async def _lookup(self, host: str, port: int, family: int) -> list[AddrInfo]:
        if self._getaddrinfo is not None:
            return await self._getaddrinfo(host, port, family)
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
        return [(int(fam), int(kind), proto, canon, tuple(addr)) for fam, kind, proto, canon, addr in infos]

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        """Resolve `host` and vet every address.

        Raises:
            TargetRefused: one of the addresses may not be reached.
            OSError: the lookup failed (aiohttp reports it as a DNS error).
        """
        literal = parse_literal_host(host)
        if literal is not None:  # aiohttp passes some literal spellings on; judge them as libc reads them
            vet(host, literal, self.allowlist)
        infos = await self._lookup(host, port, int(family))
        results: list[ResolveResult] = []
        seen: set[tuple[str, int]] = set()
        for fam, _kind, proto, _canon, sockaddr in infos:
            if fam not in (socket.AF_INET, socket.AF_INET6):
                continue
            text, resolved_port = str(sockaddr[0]), int(sockaddr[1])
            address = ip_address(text.split("%", 1)[0])
            vet(host, address, self.allowlist)
            if fam == socket.AF_INET6 and len(sockaddr) >= 4 and sockaddr[3]:
                text = f"{address}%{sockaddr[3]}"
            if (text, resolved_port) in seen:
                continue
            seen.add((text, resolved_port))
            results.append(
                ResolveResult(
                    hostname=host,
                    host=text,
                    port=resolved_port,
                    family=fam,
                    proto=proto,
                    flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
                )
            )
        if not results:
            raise OSError(f"{host} resolved to no IPv4 or IPv6 address")
        return results

    async def close(self) -> None:
        """Nothing to release."""
