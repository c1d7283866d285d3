"""http(s) image and video URLs, fetched for the hosts an operator allows and nothing else (SSRF-safe).

    fetcher = MediaFetcher(FetchPolicy(domains=frozenset({"images.example.com"}), ...))
    fetcher.start()                       # inside the gateway's event loop
    data = await fetcher.fetch(url, param="messages[0].content[1].image_url.url", max_bytes=...)

A URL is fetched only when its host is one of ``--allowed-media-domains`` (exactly, as vLLM
matches them). Every address the connection may use is checked, not the name: the resolver
the client connects through refuses private, loopback, link-local, reserved, multicast and
unspecified addresses (anything not globally routable) unless ``--allowed-media-networks``
names a range holding it, so a name that resolves to 10.0.0.5 or 169.254.169.254 is refused
and a later re-resolution cannot swap the address checked for another (the connection uses
the checked answers). IP-literal hosts, which aiohttp connects to without resolving, are
checked here before the request. Redirects are followed by hand, each hop's URL checked as
the first was. One deadline covers the whole fetch (redirects included), and the body is
read in chunks against the size limit (a ``Content-Length`` over it is refused before any
byte). No proxy from the environment is used: a proxy would connect on the gateway's behalf
to addresses nobody checked. Every refusal is a 400 naming the request field.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver

from services.gateway.errors import bad_request

REDIRECTS = (301, 302, 303, 307, 308)
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class FetchPolicy:
    domains: frozenset[str] = frozenset()  # --allowed-media-domains, lower case; empty: no fetching
    networks: tuple[IPNetwork, ...] = ()  # --allowed-media-networks: non-global ranges allowed explicitly
    timeout_s: float = 10.0  # --media-fetch-timeout: the whole fetch, redirects included
    max_redirects: int = 3  # --max-media-redirects

    @property
    def enabled(self) -> bool:
        return bool(self.domains)

    def address_refusal(self, address: str) -> str | None:
        """What kind of non-public address this is ("private", "loopback", ...) when it may not be connected to;
        None when it may (public, or in an allowed range)."""
        try:
            ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
        except ValueError:
            return "malformed"
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:10.0.0.1 reaches 10.0.0.1
        if any(ip in net for net in self.networks):
            return None
        if ip.is_global and not ip.is_multicast:
            return None
        return ("loopback" if ip.is_loopback else "link-local" if ip.is_link_local
                else "private" if ip.is_private else "multicast" if ip.is_multicast else "reserved")


ALLOW_HINT = "allow its range with --allowed-media-networks"


def parse_networks(text: str | None) -> tuple[IPNetwork, ...]:
    """--allowed-media-networks "127.0.0.0/8,::1/128" -> networks (ValueError naming a bad one)."""
    out = []
    for item in (text or "").split(","):
        if item.strip():
            out.append(ipaddress.ip_network(item.strip(), strict=False))
    return tuple(out)


def check_url(policy: FetchPolicy, url: str, *, what: str, param: str, kind: str = "image") -> None:
    """The checks that need no network: scheme, an allowed host, an IP literal's range. Parsing calls it
    so a refused URL is a 400 before anything else happens. `kind`: "image" or "video", for the codes."""
    if not policy.enabled:
        raise bad_request(f"{what}: http(s) URLs are not fetched by this gateway unless it is started with "
                          f"--allowed-media-domains HOST,...; send the {kind} inline as data:{kind}/<type>;base64,...",
                          param, f"unsupported_{kind}_url")
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise bad_request(f"{what}: malformed URL ({exc})", param, f"invalid_{kind}_url") from None
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise bad_request(f"{what}: only http(s) URLs with a host are fetched", param, f"invalid_{kind}_url")
    if host not in policy.domains:
        raise bad_request(f"{what}: host {host!r} is not in --allowed-media-domains", param,
                          "media_domain_not_allowed")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return  # a name: its addresses are checked when it is resolved
    kind = policy.address_refusal(host)
    if kind is not None:
        raise bad_request(f"{what}: {host} is a {kind} address; {ALLOW_HINT}", param, "media_address_not_allowed")


class _Refused(Exception):
    """Raised by the resolver: not an OSError, so aiohttp lets it through unchanged."""


class _CheckedResolver(AbstractResolver):
    """The system resolver, with every answer checked against the policy before a connection uses it."""

    def __init__(self, policy: FetchPolicy):
        self.policy = policy
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        answers = await self._inner.resolve(host, port, family)
        # Only the allowed answers go back: the connection can use no other address.
        allowed = [a for a in answers if self.policy.address_refusal(a["host"]) is None]
        if not allowed:
            first = answers[0]["host"] if answers else "nothing"
            kind = self.policy.address_refusal(first) if answers else "no"
            raise _Refused(f"{host} resolves to {first}, a {kind} address; {ALLOW_HINT}")
        return allowed

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    def __init__(self, policy: FetchPolicy):
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """In the event loop that will fetch (the session belongs to it)."""
        if self.policy.enabled and self._session is None:
            connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self.policy), limit=64)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  headers={"User-Agent": "modalmesh-gateway"})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, *, what: str, param: str, max_bytes: int, kind: str = "image") -> bytes:
        """The body of `url` after at most max_redirects checked redirects; a 400 for anything refused."""
        check_url(self.policy, url, what=what, param=param, kind=kind)
        assert self._session is not None, "MediaFetcher.start() first"
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                for _ in range(self.policy.max_redirects + 1):
                    async with self._session.get(url, allow_redirects=False) as response:
                        if response.status in REDIRECTS:
                            location = response.headers.get("Location")
                            if not location:
                                raise bad_request(f"{what}: HTTP {response.status} without a Location", param,
                                                  "media_fetch_failed")
                            url = urljoin(url, location)
                            check_url(self.policy, url, what=f"{what} (redirected)", param=param, kind=kind)
                            continue
                        if response.status != 200:
                            raise bad_request(f"{what}: the server answered HTTP {response.status}", param,
                                              "media_fetch_failed")
                        return await _read(response, what=what, param=param, max_bytes=max_bytes, kind=kind)
                raise bad_request(f"{what}: more than {self.policy.max_redirects} redirects "
                                  "(--max-media-redirects)", param, "media_fetch_failed")
        except TimeoutError:
            raise bad_request(f"{what}: fetching took longer than {self.policy.timeout_s:g} s "
                              "(--media-fetch-timeout)", param, "media_fetch_timeout") from None
        except _Refused as exc:
            raise bad_request(f"{what}: {exc}", param, "media_address_not_allowed") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise bad_request(f"{what}: fetching failed ({type(exc).__name__}: {exc})", param,
                              "media_fetch_failed") from None


async def _read(response: aiohttp.ClientResponse, *, what: str, param: str, max_bytes: int,
                kind: str = "image") -> bytes:
    declared = response.content_length
    if declared is not None and declared > max_bytes:
        raise bad_request(f"{what} is {declared} bytes; this server accepts at most {max_bytes} bytes", param,
                          f"{kind}_too_large")
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > max_bytes:  # no or a false Content-Length (or a compressed body): stop reading
            raise bad_request(f"{what} is more than {max_bytes} bytes; this server accepts at most {max_bytes} bytes",
                              param, f"{kind}_too_large")
    if not body:
        raise bad_request(f"{what}: the server sent no data", param, f"invalid_{kind}")
    return bytes(body)


async def fetch_all(jobs) -> list[bytes]:
    """Await every fetch concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

