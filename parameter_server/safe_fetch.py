"""GET a URL a user named, without letting it reach the worker's own network (server-side request forgery).

A job's model may be a URL (``model.source.url``). The parameter server that fetches it runs on a worker,
inside the worker's network: without a check, ``http://127.0.0.1:8530/internal/…`` or
``http://169.254.169.254/…`` (a cloud's metadata service) would be fetched with the worker's reach and its
answer served back to the job's owner as "the model". So :func:`open_checked`:

* resolves the host and refuses it if **any** address is loopback, private, link-local, multicast, reserved or
  unspecified (IPv4-mapped IPv6 addresses are judged as their IPv4 address);
* connects to the address it checked, not to a second lookup of the name (a DNS answer that changes between
  the check and the connection — DNS rebinding — cannot slip a private address in); TLS still verifies the
  certificate against the host *name*;
* follows at most :data:`MAX_REDIRECTS` redirects itself, checking every hop the same way.

The operator opens exceptions with ``HYPHA_ALLOW_PRIVATE_URLS`` in the daemon's environment (inherited by the
parameter server): ``1`` allows every address, a comma-separated list of addresses or CIDR networks
(``10.0.0.0/8,127.0.0.1``) allows those. Tests that serve models on loopback set it.

Downloads go straight to the host: ``HTTP(S)_PROXY`` is not used for these URLs. The control plane's own files
(uploads, checkpoints) and the data nodes' signed slice URLs are not user input and do not come through here.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import socket
import ssl
import urllib.parse
from dataclasses import dataclass

from parameter_server.exceptions import JobConfigError, ModelSourceError
from worker_daemon.protocol import is_public_address

ALLOW_ENV = "HYPHA_ALLOW_PRIVATE_URLS"
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Allowance:
    """Which non-public addresses the operator allows: all of them, or those in ``networks``."""

    everything: bool = False
    networks: tuple[IPNetwork, ...] = ()

    def permits(self, address: IPAddress) -> bool:
        return self.everything or any(address in network for network in self.networks)


def allowed_private_networks(value: str | None = None) -> Allowance:
    """The allowance in ``value`` (default: ``$HYPHA_ALLOW_PRIVATE_URLS``); ``JobConfigError`` if malformed."""
    raw = os.environ.get(ALLOW_ENV, "") if value is None else value
    lowered = raw.strip().lower()
    if lowered in {"", "0", "false", "no", "off"}:
        return Allowance()
    if lowered in {"1", "true", "yes", "on"}:
        return Allowance(everything=True)
    networks = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as error:
            raise JobConfigError(
                f"{ALLOW_ENV}={raw!r}: {item!r} is not an address or CIDR network ({error})"
            ) from None
    return Allowance(networks=tuple(networks))


def checked_addresses(host: str, port: int, allowance: Allowance, *, what: str) -> list[str]:
    """The addresses ``host`` resolves to, all of them public or allowed; ``ModelSourceError`` otherwise."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise ModelSourceError(f"{what}: cannot resolve {host}: {error}") from None
    addresses: list[str] = []
    for *_, sockaddr in found:
        text = str(sockaddr[0]).split("%", 1)[0]  # an IPv6 zone (fe80::1%eth0) is not part of the address
        address = ipaddress.ip_address(text)
        if not is_public_address(address) and not allowance.permits(address):
            raise ModelSourceError(
                f"{what}: {address} is not a public address (host {host!r}); loopback, private, link-local, "
                f"multicast and reserved addresses are refused unless {ALLOW_ENV} allows them"
            )
        if text not in addresses:
            addresses.append(text)
    if not addresses:
        raise ModelSourceError(f"{what}: {host} has no address")
    return addresses


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to ``address`` for the URL's host (the ``Host`` header keeps the name)."""

    def __init__(self, host: str, port: int, *, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """As :class:`_PinnedHTTPConnection`, with TLS verified against the host name (SNI and certificate)."""

    def __init__(self, host: str, port: int, *, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)


def open_checked(url: str, allowance: Allowance, *, timeout: float) -> http.client.HTTPResponse:
    """``GET url``, following redirects, every hop's addresses checked; the 200 response, open (the caller
    closes it). Raises ``ModelSourceError`` for a refused address, a bad URL, too many redirects or another
    status; ``OSError``/``http.client.HTTPException`` for network failures."""
    what = url
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as error:
            raise ModelSourceError(f"{what}: {error}") from None
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ModelSourceError(f"{what}: only http and https URLs with a host can be fetched")
        address = checked_addresses(parts.hostname, port, allowance, what=what)[0]
        kind = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        connection = kind(parts.hostname, port, address=address, timeout=timeout)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            connection.request("GET", path, headers={"Accept-Encoding": "identity"})
            response = connection.getresponse()
        except BaseException:
            connection.close()
            raise
        if response.status in _REDIRECTS:
            location = response.getheader("Location")
            response.close()
            connection.close()
            if not location:
                raise ModelSourceError(f"{what}: a {response.status} redirect without a Location")
            url = urllib.parse.urljoin(url, location)
            what = f"{what} (redirect to {url})"
            continue
        if response.status != 200:
            response.close()
            connection.close()
            raise ModelSourceError(f"{what} answered {response.status} {response.reason}")
        return response
    raise ModelSourceError(f"{what}: more than {MAX_REDIRECTS} redirects")
