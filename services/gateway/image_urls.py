"""Remote image URLs of OpenAI chat messages, fetched by the gateway under an operator's rules.

Off by default: with no `image_url_hosts` every non-`data:` URL is a 400. With hosts listed
(`example.com` exactly, `*.example.com` its subdomains), a URL is fetched only when:

- its scheme is https (http too only with `image_url_allow_http`), it has no credentials, and its
  host is listed;
- every address the host resolves to is public — not private, loopback, link-local, multicast,
  reserved or unspecified — unless `image_url_allow_private` (a DNS answer cannot point the
  gateway at its own network). The connection uses the addresses checked (no second lookup, so a
  rebinding DNS answer does not get past the check);
- it answers 200 without a redirect (a redirect could lead anywhere), within
  `image_url_timeout_s` for the whole fetch, with at most `max_image_bytes` of body (read in
  pieces; the fetch stops at the limit).

The bytes then go through the same checks as any image (services/gateway/validation.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver


class ImageUrlError(Exception):
    """A URL refused or a fetch that failed: a 400 naming the field."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def host_allowed(host: str, patterns: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for p in patterns:
        p = p.lower().rstrip(".")
        if host == p or (p.startswith("*.") and host.endswith(p[1:])):
            return True
    return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved or ip.is_unspecified
    )


class _CheckedResolver(AbstractResolver):
    """aiohttp's resolver with every answer checked (_public) before it is connected to."""

    def __init__(self, allow_private: bool) -> None:
        self._inner = aiohttp.ThreadedResolver()
        self._allow_private = allow_private

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        answers = await self._inner.resolve(host, port, family)
        if not self._allow_private and any(not _public(a["host"]) for a in answers):
            raise ImageUrlError(f"{host} resolves to a private or local address", "image_url_refused")
        return answers

    async def close(self) -> None:
        await self._inner.close()


class ImageFetcher:
    def __init__(
        self, hosts: list[str], max_bytes: int, timeout_s: float, allow_http: bool = False, allow_private: bool = False
    ) -> None:
        self.hosts, self.max_bytes, self.timeout_s = hosts, max_bytes, timeout_s
        self.allow_http, self.allow_private = allow_http, allow_private
        self._session: aiohttp.ClientSession | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.hosts)

    def check(self, url: str) -> None:
        """Refuses a URL the rules do not allow (before any network access)."""
        parts = urlsplit(url)
        schemes = ("https", "http") if self.allow_http else ("https",)
        if parts.scheme not in schemes:
            raise ImageUrlError(f"image URLs must be {' or '.join(schemes)}:// (or data:)", "image_url_refused")
        if parts.username or parts.password or not parts.hostname:
            raise ImageUrlError("an image URL needs a host and no credentials", "image_url_refused")
        if not host_allowed(parts.hostname, self.hosts):
            raise ImageUrlError(
                f"{parts.hostname} is not one of the hosts images may come from (VALORA_IMAGE_URL_HOSTS)",
                "image_url_refused",
            )
        if not self.allow_private and _is_ip(parts.hostname) and not _public(parts.hostname):
            # an address literal is connected to as is (no lookup for the resolver to check)
            raise ImageUrlError(f"{parts.hostname} is a private or local address", "image_url_refused")

    async def fetch(self, url: str) -> tuple[bytes, str]:
        """(body, content type) of an allowed URL; ImageUrlError otherwise."""
        self.check(url)
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self.allow_private), limit=64)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._session.get(url, allow_redirects=False) as resp:
                    if resp.status != 200:
                        raise ImageUrlError(
                            f"fetching the image answered HTTP {resp.status} (redirects are not followed)",
                            "image_url_fetch_failed",
                        )
                    if resp.content_length is not None and resp.content_length > self.max_bytes:
                        raise ImageUrlError(
                            f"the image is {resp.content_length} bytes, over {self.max_bytes}", "image_url_too_large"
                        )
                    body = bytearray()
                    async for piece in resp.content.iter_chunked(1 << 16):
                        body += piece
                        if len(body) > self.max_bytes:
                            raise ImageUrlError(f"the image is over {self.max_bytes} bytes", "image_url_too_large")
                    return bytes(body), resp.headers.get("Content-Type", "").split(";")[0].strip()
        except ImageUrlError:
            raise
        except TimeoutError:
            raise ImageUrlError(f"fetching the image took over {self.timeout_s} s", "image_url_fetch_failed") from None
        except aiohttp.ClientConnectorError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, ImageUrlError):
                raise cause from None
            raise ImageUrlError(
                f"cannot reach the image's host: {exc.strerror or exc}", "image_url_fetch_failed"
            ) from None
        except aiohttp.ClientError as exc:
            raise ImageUrlError(f"fetching the image failed: {type(exc).__name__}", "image_url_fetch_failed") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
