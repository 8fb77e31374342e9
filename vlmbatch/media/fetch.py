"""Downloading media over http(s) without letting a row hang, flood or pivot a worker.

Used by batch jobs (the user's own URLs: private hosts allowed by default) and by the
OpenAI-compatible server (untrusted URLs: `allow_private=False`). Every failure is a
`RowError` with the type users filter on; nothing here raises anything else.

The private-address guard resolves the host and refuses it when any address is not
globally routable, and it does so again for every redirect hop (redirects are followed
by hand). It does not pin the connection to the checked address, so a DNS answer that
changes between the check and the connect (rebinding) is not caught; a deployment that
must defend against that should also filter egress at the network level.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from dataclasses import dataclass

import httpx

from vlmbatch.config import MediaConfig
from vlmbatch.errors import ErrorType, RowError

IMAGE_MAX_BYTES = 64 * 1024**2
VIDEO_MAX_BYTES = 512 * 1024**2
RETRY_BACKOFF_S = 0.2
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# Cloud metadata endpoints; both are also caught as link-local/private, named here to be explicit.
METADATA_ADDRESSES = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")})

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DEFAULTS = MediaConfig()  # without a configuration: the documented defaults, not the environment


@dataclass(frozen=True)
class FetchPolicy:
    """Limits for one download. The defaults suit images; `for_images(config)` and
    `for_videos(config)` take the timeouts of a process's `MediaConfig`.

    `timeout` bounds the whole download (retries and redirects included), not each read,
    so a server dripping bytes cannot hold a row forever. `allowed_domains` matches a
    host and its subdomains. `allowed_networks` (CIDRs) are exempt from the private
    guard, e.g. an internal CDN the server may use.
    """

    timeout: float = DEFAULTS.image_fetch_timeout
    max_bytes: int = IMAGE_MAX_BYTES
    retries: int = 2
    allowed_domains: tuple[str, ...] | None = None
    allow_private: bool = True
    allowed_networks: tuple[str, ...] = ()
    max_redirects: int = 5

    def __post_init__(self) -> None:
        if self.allowed_domains is not None:
            domains = tuple(d.strip().strip(".").lower() for d in self.allowed_domains if d.strip().strip("."))
            object.__setattr__(self, "allowed_domains", domains)
        object.__setattr__(self, "allowed_networks", tuple(self.allowed_networks))

    @classmethod
    def for_images(cls, config: MediaConfig = DEFAULTS, **overrides: object) -> "FetchPolicy":
        settings: dict = {"timeout": config.image_fetch_timeout, **overrides}
        return cls(**settings)

    @classmethod
    def for_videos(cls, config: MediaConfig = DEFAULTS, **overrides: object) -> "FetchPolicy":
        settings: dict = {"timeout": config.video_fetch_timeout, "max_bytes": VIDEO_MAX_BYTES, **overrides}
        return cls(**settings)


class _Retryable(Exception):
    """A failure worth another try (5xx, connection trouble); becomes MEDIA_FETCH at the end."""


def host_allowed(host: str, allowed_domains: tuple[str, ...] | None) -> bool:
    host = host.strip(".").lower()
    if allowed_domains is None:
        return True
    return any(host == domain or host.endswith("." + domain) for domain in allowed_domains)


def is_public_address(address: IPAddress, allowed_networks: tuple[str, ...] = ()) -> bool:
    """True for globally routable unicast addresses (or ones inside `allowed_networks`)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address in ipaddress.ip_network(network, strict=False) for network in allowed_networks):
        return True
    return address.is_global and not address.is_multicast and address not in METADATA_ADDRESSES


def _short(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


def _check_url(url: httpx.URL, policy: FetchPolicy) -> None:
    """Scheme, domain allow-list and (when asked) the private-address guard, for one hop."""
    if url.scheme not in ("http", "https"):
        raise RowError(ErrorType.MEDIA_FORBIDDEN, f"URL scheme {url.scheme!r} is not allowed (http/https only)")
    if not url.host:
        raise RowError(ErrorType.MEDIA_FETCH, f"URL has no host: {_short(str(url))}")
    if not host_allowed(url.host, policy.allowed_domains):
        raise RowError(ErrorType.MEDIA_FORBIDDEN, f"host {url.host} is not in the allowed media domains")
    if policy.allow_private:
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise RowError(ErrorType.MEDIA_FETCH, f"cannot resolve {url.host}: {exc}") from exc
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not is_public_address(address, policy.allowed_networks):
            raise RowError(
                ErrorType.MEDIA_FORBIDDEN, f"host {url.host} resolves to {address}, a private or reserved address"
            )


_client_lock = threading.Lock()
_client_state: tuple[int, httpx.Client] | None = None


def _client() -> httpx.Client:
    """One pooled client per process (keep-alive and TLS reuse); a forked child makes its own."""
    global _client_state
    with _client_lock:
        if _client_state is None or _client_state[0] != os.getpid():
            _client_state = (os.getpid(), httpx.Client(follow_redirects=False))
        return _client_state[1]


def _remaining(deadline: float, url: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise RowError(ErrorType.MEDIA_TIMEOUT, f"download did not finish in time: {_short(url)}")
    return left


def _read_capped(response: httpx.Response, policy: FetchPolicy, deadline: float, url: str) -> bytes:
    too_large = f"media is larger than the {policy.max_bytes:,}-byte limit: {_short(url)}"
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_bytes:
        raise RowError(ErrorType.MEDIA_TOO_LARGE, too_large)
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > policy.max_bytes:
            raise RowError(ErrorType.MEDIA_TOO_LARGE, too_large)
        _remaining(deadline, url)
    return bytes(body)


def _fetch_once(url: str, policy: FetchPolicy, deadline: float) -> bytes:
    try:
        current = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise RowError(ErrorType.MEDIA_FETCH, f"invalid URL {_short(url)}: {exc}") from exc
    for _ in range(policy.max_redirects + 1):
        _check_url(current, policy)
        with _client().stream("GET", current, timeout=_remaining(deadline, url)) as response:
            status = response.status_code
            if status in REDIRECT_STATUSES and "location" in response.headers:
                current = current.join(response.headers["location"])
                continue
            if status in (404, 410):
                raise RowError(ErrorType.MEDIA_NOT_FOUND, f"HTTP {status} for {_short(str(current))}")
            if status >= 500:
                raise _Retryable(f"HTTP {status} for {_short(str(current))}")
            if not 200 <= status < 300:
                raise RowError(ErrorType.MEDIA_FETCH, f"HTTP {status} for {_short(str(current))}")
            return _read_capped(response, policy, deadline, url)
    raise RowError(ErrorType.MEDIA_FETCH, f"more than {policy.max_redirects} redirects: {_short(url)}")


def fetch_bytes(url: str, policy: FetchPolicy | None = None) -> bytes:
    """Download `url` under `policy`; every failure is a `RowError` (never retries a 4xx)."""
    policy = policy or FetchPolicy()
    deadline = time.monotonic() + policy.timeout
    attempt = 0
    while True:
        try:
            return _fetch_once(url, policy, deadline)
        except httpx.TimeoutException as exc:
            raise RowError(ErrorType.MEDIA_TIMEOUT, f"download timed out after {policy.timeout:g} s: {_short(url)}") from exc
        except (_Retryable, httpx.TransportError) as exc:
            message = str(exc) or type(exc).__name__
            backoff = RETRY_BACKOFF_S * 2**attempt
            if attempt == policy.retries or time.monotonic() + backoff >= deadline:
                raise RowError(ErrorType.MEDIA_FETCH, f"cannot download {_short(url)}: {message}") from exc
            time.sleep(backoff)
            attempt += 1
