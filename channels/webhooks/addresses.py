"""Where an outbound webhook may go: https to public addresses only (no loopback, private,
link-local, multicast or reserved targets, however the address is written: every host is
resolved, at creation and again at each connection, and each address it resolves to is
checked), unless private targets are allowed (tests, local development), which also allows
plain http. Redirects are never followed, so a receiver cannot bounce a delivery inward."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

MAX_URL = 2_000


class Refused(ValueError):
    """The URL, or an address it resolves to, is not a place keel delivers to."""


# IPv6 ranges that carry an IPv4 address a network may route to: refused outright rather than
# trusting what they embed (the IPv4-mapped form, ::ffff:0:0/96, is judged by its IPv4 address)
EMBEDDING = [
    ipaddress.ip_network(n)
    for n in (
        "64:ff9b::/96",  # NAT64
        "64:ff9b:1::/48",  # NAT64, local use
        "2002::/16",  # 6to4
        "2001::/32",  # Teredo
        "::/96",  # IPv4-compatible (deprecated)
        "::ffff:0:0:0/96",  # IPv4-translated (SIIT)
    )
]


def public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif any(ip in net for net in EMBEDDING):
            return False
    return ip.is_global and not ip.is_multicast


def check_url(url: str, *, allow_private: bool) -> tuple[str, int]:
    """The URL's host and port, if its form is one keel delivers to (addresses not checked)."""
    if len(url) > MAX_URL:
        raise Refused(f"the URL is longer than {MAX_URL} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise Refused("the URL cannot be parsed") from None
    schemes = ("https", "http") if allow_private else ("https",)
    if parts.scheme not in schemes:
        raise Refused("the URL must be https" + (" or http" if allow_private else ""))
    if not parts.hostname or parts.username or parts.password:
        raise Refused("the URL needs a host and no user or password")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


async def check_host(host: str, port: int, *, allow_private: bool) -> list[str]:
    """The addresses `host` resolves to; Refused if it resolves to none, or to one that is not
    public (unless private targets are allowed)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise Refused(f"{host} does not resolve") from None
    addresses = sorted({str(info[4][0]) for info in infos})
    if not allow_private:
        for address in addresses:
            if not public(address):
                raise Refused(f"{host} resolves to {address}, which is not a public address")
    return addresses


class PublicResolver(AbstractResolver):
    """aiohttp's resolver for deliveries: a host that resolves to a non-public address is not
    connected to (DNS answers that changed since the subscription was made included)."""

    def __init__(self, *, allow_private: bool) -> None:
        self.allow_private = allow_private
        self.inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        if not self.allow_private:
            for entry in found:
                if not public(str(entry["host"])):
                    raise OSError(f"{host} resolves to {entry['host']}, which is not a public address")
        return found

    async def close(self) -> None:
        await self.inner.close()
