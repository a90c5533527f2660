"""Webhook deliveries: where they may go, how they are signed, what is kept of the answer.

Destination policy (docs/audits.md, "Where a webhook may go"): public addresses only, an IPv6
address carrying an IPv4 one judged by the IPv4 address, unless the operator's allowlist names
the host or a network holding the address; credentials in the URL always refused. The check
that counts is at delivery: every address the name resolves to then must pass, and the
connection goes to a checked address (a DNS answer that changes in between cannot redirect
it). At creation only the obvious is refused (IP literals, `localhost` names), since a name's
addresses may change before any delivery.

Signing follows Stripe and GitHub: `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." +
body)>` over the exact body bytes. The secret is stored in clear, since signing needs it.

Only the status code and one of `ERROR_CLASSES` are kept of an attempt, never the receiver's
body or an exception text (they reach auditors, and may carry internal detail).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Final, Literal, get_args
from urllib.parse import urlsplit

import httpx

from replay_audit.exceptions import FieldError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SIGNATURE_HEADER: Final = "X-Replay-Audit-Signature"
SECRET_PREFIX: Final = "whsec_"

#: What an attempt's `error` may be (None when it was delivered).
ErrorClass = Literal[
    "refused_destination",  # the policy refused the address (or credentials in the URL)
    "dns_error",  # the host name did not resolve
    "timeout",  # no answer within webhook_timeout_s
    "connection_refused",  # nothing listens there
    "tls_error",  # the TLS handshake or certificate failed
    "connection_error",  # any other transport failure
    "http_3xx",  # a redirect (never followed)
    "http_4xx",
    "http_5xx",
]
ERROR_CLASSES: Final[tuple[str, ...]] = get_args(ErrorClass)

#: Names that mean this host (RFC 6761) or a cloud metadata service, refused by name at creation.
_LOCAL_NAMES: Final = frozenset(
    {
        "localhost",
        "localhost.localdomain",
        "ip6-localhost",
        "ip6-loopback",
        "metadata.google.internal",
    }
)
#: IPv6 networks whose low 32 bits are an IPv4 address: IPv4-compatible (`::a.b.c.d`,
#: deprecated but still routed to the IPv4 host by some stacks), IPv4-translated
#: (`::ffff:0:a.b.c.d`) and NAT64 (`64:ff9b::a.b.c.d`).
_IPV4_CARRIERS: Final = tuple(
    ipaddress.IPv6Network(n) for n in ("::/96", "::ffff:0:0:0/96", "64:ff9b::/96")
)
#: A host that inet_aton reads as an IPv4 address (decimal, hex, octal, short forms).
_LEGACY_IPV4: Final = re.compile(r"^(0x[0-9a-f]+|[0-9]+)(\.(0x[0-9a-f]+|[0-9]+)){0,3}$")


class RefusedDestination(Exception):
    """The policy refuses this destination."""


def _normal_host(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _embedded_ipv4(address: IPAddress) -> list[IPAddress]:
    """The IPv4 addresses an IPv6 address carries (mapped, compatible, translated, 6to4,
    NAT64), to be judged too."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    inner: list[IPAddress] = []
    if address.ipv4_mapped is not None:
        inner.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        inner.append(address.sixtofour)
    if any(address in net for net in _IPV4_CARRIERS):
        inner.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return inner


def is_public(address: IPAddress) -> bool:
    """A globally routable unicast address, and so is any IPv4 address it carries."""
    if not address.is_global or address.is_multicast:
        return False
    return all(is_public(inner) for inner in _embedded_ipv4(address))


def ip_literal(host: str) -> IPAddress | None:
    """The address a URL host names literally, in any form a resolver accepts (`2130706433`,
    `0x7f000001`, `0177.0.0.1`, `127.1`, `[::1]`), or None for a name."""
    host = _normal_host(host)
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        pass
    if _LEGACY_IPV4.match(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


@dataclass(frozen=True)
class DestinationPolicy:
    """Public addresses, plus what the operator's allowlist names: host names (matched exactly,
    any address they resolve to) and networks or single addresses."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = field(default=())

    @classmethod
    def parse(cls, entries: list[str] | tuple[str, ...]) -> DestinationPolicy:
        """From allowlist entries: `hooks.internal`, `127.0.0.1`, `10.0.0.0/8`, `::1`, ...
        ValueError for an entry that is neither a host name nor an address or network."""
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = _normal_host(raw)
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if "/" in entry or not re.fullmatch(r"[a-z0-9._-]+", entry):
                raise ValueError(f"webhook allowlist: {raw!r} is not a host name or network")
            hosts.add(entry)
        return cls(hosts=frozenset(hosts), networks=tuple(networks))

    def names(self, host: str) -> bool:
        return _normal_host(host) in self.hosts

    def allows(self, address: IPAddress) -> bool:
        """Whether a connection to `address` may be made."""
        candidates = [address, *_embedded_ipv4(address)]
        if any(a in n for a in candidates for n in self.networks if a.version == n.version):
            return True
        return is_public(address)


#: The default: public addresses only.
STRICT: Final = DestinationPolicy()


def check_url(url: str, policy: DestinationPolicy, *, field: str = "webhook_url") -> None:
    """Refuse, at creation or change, a URL that carries credentials or names an internal host
    literally (an IP address in any form, a `localhost` name) that the allowlist does not name.
    Names are judged again, resolved, at every delivery."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FieldError("a webhook URL is http:// or https:// with a host", field=field)
    if parts.username is not None or parts.password is not None:
        raise FieldError(
            "a webhook URL may not carry credentials; receivers verify the signature header",
            field=field,
        )
    host = parts.hostname
    if policy.names(host):
        return
    literal = ip_literal(host)
    if literal is not None and not policy.allows(literal):
        raise FieldError(
            f"webhook destination {literal} is not a public address (loopback, private, "
            "link-local and reserved ranges are refused unless "
            "REPLAY_AUDIT_WEBHOOK_ALLOWED_HOSTS names them)",
            field=field,
        )
    name = _normal_host(host)
    if literal is None and (name in _LOCAL_NAMES or name.endswith(".localhost")):
        raise FieldError(
            f"webhook host {name!r} is this machine or a metadata service (refused unless "
            "REPLAY_AUDIT_WEBHOOK_ALLOWED_HOSTS names it)",
            field=field,
        )


def new_secret() -> str:
    """A new signing secret for a schedule's webhook (256 bits)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def signature(secret: str, body: bytes, at: int | None = None) -> str:
    """`t=<unix>,v1=<hex>`: HMAC-SHA256 with `secret` over `<t>.` followed by the body."""
    t = int(time.time()) if at is None else at
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


@dataclass(frozen=True)
class Attempt:
    """What is kept of one POST: the answer's status code (None without an answer) and the
    error class (None when delivered, a 2xx)."""

    status_code: int | None
    error: ErrorClass | None

    @property
    def ok(self) -> bool:
        return self.error is None


def pinned_addresses(url: httpx.URL, policy: DestinationPolicy) -> list[str]:
    """The addresses to connect to for `url`, in the resolver's order: its host resolved now,
    every address checked. RefusedDestination if any is refused (one internal answer among
    public ones is enough to refuse); socket.gaierror if it does not resolve."""
    if url.userinfo:
        raise RefusedDestination("credentials in the URL")
    host = url.host
    port = url.port or (443 if url.scheme == "https" else 80)
    addresses: list[IPAddress] = []
    for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise socket.gaierror(f"{host} has no address")
    if not policy.names(host):
        refused = [a for a in addresses if not policy.allows(a)]
        if refused:
            raise RefusedDestination(f"{host} resolves to {refused[0]}")
    return [str(a) for a in addresses]


def _caused_by(error: BaseException, kind: type[BaseException]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _transport_error(error: httpx.HTTPError) -> ErrorClass:
    if isinstance(error, httpx.TimeoutException):
        return "timeout"
    if _caused_by(error, ssl.SSLError):
        return "tls_error"
    if _caused_by(error, ConnectionRefusedError):
        return "connection_refused"
    return "connection_error"


def _status_class(status_code: int) -> ErrorClass | None:
    if 200 <= status_code < 300:
        return None
    if status_code < 400:
        return "http_3xx"
    return "http_4xx" if status_code < 500 else "http_5xx"


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    policy: DestinationPolicy,
) -> Attempt:
    """POST `body` (JSON) to `url` once, under the destination policy (module docstring). A
    name with several addresses is tried on each in turn while nothing answers there."""
    try:
        target = httpx.URL(url)
        addresses = pinned_addresses(target, policy)
    except RefusedDestination:
        return Attempt(None, "refused_destination")
    except (socket.gaierror, UnicodeError):
        return Attempt(None, "dns_error")
    except httpx.InvalidURL:
        return Attempt(None, "refused_destination")
    # Connect to a checked address; the Host header and TLS (SNI, certificate) keep the name.
    request_headers = {**headers, "Host": target.netloc.decode("ascii")}
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    attempt = Attempt(None, "connection_error")
    with httpx.Client(trust_env=False, follow_redirects=False, timeout=timeout_s) as client:
        for address in addresses:
            try:
                answer = client.post(
                    target.copy_with(host=address),
                    content=body,
                    headers=request_headers,
                    extensions=extensions,
                )
            except httpx.HTTPError as e:
                attempt = Attempt(None, _transport_error(e))
                if isinstance(e, httpx.ConnectError) and attempt.error != "tls_error":
                    continue  # nothing answers at this address: the next one
                return attempt
            return Attempt(answer.status_code, _status_class(answer.status_code))
    return attempt
