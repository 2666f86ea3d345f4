"""Where a fleet-initiated download may go.

A `deploy_bundle` names a URL that the device then fetches: without limits, whoever can send one makes
the device read its own files (`file://`), its own loopback API, or a cloud metadata service, and keep
what it got. So a fleet download is http(s) only (`file://` only with `[ota] allow_file_urls`), and never
connects to a loopback, unspecified or link-local address (IPv4-mapped and other IPv6 forms that embed
one included) unless `[ota] allow_loopback_urls` / `allow_link_local_urls` say so. LAN addresses stay
allowed: bundle mirrors usually live there.

The address is checked where the connection is made: the host is resolved once, every address it
resolves to is checked, and the socket connects to one of exactly those addresses (a name that resolves
to something else a moment later, DNS rebinding, changes nothing). Each redirect is a new connection,
checked the same way; a redirect to another scheme is refused. Such downloads connect directly: an HTTP
proxy from the environment would resolve and connect on its own, out of reach of the check.

Operator installs (`edgeserve bundle install` on the device, the appliance's 0600 socket) take no
policy: the operator may install from a local file or any URL.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 prefixes that carry an IPv4 address in their low 32 bits (RFC 6052 NAT64, RFC 4291 "compatible").
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")  # Linux connects 0.0.0.0 to this very host
_METADATA = ipaddress.IPv4Address("169.254.169.254")

LOOPBACK, LINK_LOCAL, NOT_UNICAST = "loopback", "link-local", "not-unicast"


class UrlRefused(Exception):
    """The URL, a redirect or the address a host resolves to is not allowed; one line for an operator.
    Not an OSError on purpose: urllib would take it for a network error, and the download would retry."""


@dataclass(frozen=True)
class UrlPolicy:
    allow_file: bool = False
    allow_loopback: bool = False
    allow_link_local: bool = False

    def refusal(self, address: IPAddress) -> str | None:
        """Why a connection to `address` is refused, or None."""
        kind, detail = classify(address)
        if kind is None:
            return None
        if kind == LOOPBACK and self.allow_loopback:
            return None
        if kind == LINK_LOCAL and self.allow_link_local:
            return None
        setting = {LOOPBACK: "allow_loopback_urls", LINK_LOCAL: "allow_link_local_urls"}.get(kind)
        hint = f"; [ota] {setting} = true allows it" if setting else ""
        return f"{address} is {detail}: fleet downloads never go there{hint}"


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64 or (address in _V4_COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def classify(address: IPAddress) -> tuple[str | None, str]:
    """(LOOPBACK | LINK_LOCAL | NOT_UNICAST, a description) for an address a download must not reach
    by default; (None, "") for an ordinary unicast one, public or LAN."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_v4(address)
        if inner is not None:
            kind, detail = classify(inner)
            return kind, f"{detail} (IPv4 {inner} inside an IPv6 address)" if kind else ""
        if address.is_loopback:
            return LOOPBACK, "the loopback address"
        if address.is_unspecified:
            return LOOPBACK, "the unspecified address (it reaches this device)"
        if address.is_link_local:
            return LINK_LOCAL, "a link-local address"
        if address.is_multicast:
            return NOT_UNICAST, "a multicast address"
        return None, ""
    if address.is_loopback:
        return LOOPBACK, "a loopback address"
    if address in _THIS_NETWORK:
        return LOOPBACK, "in 0.0.0.0/8 (it reaches this device)"
    if address == _METADATA:
        return LINK_LOCAL, "the cloud metadata service (link-local)"
    if address.is_link_local:
        return LINK_LOCAL, "a link-local address"
    if address.is_multicast or address.is_reserved:  # reserved: 240/4, broadcast included
        return NOT_UNICAST, "not a unicast address"
    return None, ""


def parse_address(text: str) -> IPAddress | None:
    """An IP literal (IPv6 with or without brackets and zone), or None for a name."""
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def check_url(url: str, policy: UrlPolicy, *, redirect: bool = False) -> None:
    """The scheme, and the host when it is an IP literal (names are checked when they are resolved)."""
    what = "redirect to" if redirect else "URL"
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
    except ValueError as exc:
        raise UrlRefused(f"{what} {url!r} refused: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in ("", "file") and not redirect:
        if not policy.allow_file:
            raise UrlRefused(
                f"{what} {url!r} refused: a fleet download must be http(s):// "
                "(local files only with [ota] allow_file_urls = true)"
            )
        return
    if scheme not in ("http", "https"):
        raise UrlRefused(f"{what} {url!r} refused: only http(s):// is allowed")
    if not host:
        raise UrlRefused(f"{what} {url!r} refused: no host")
    address = parse_address(host)
    if address is None and parts.netloc.rpartition("@")[2].startswith("["):
        # urlsplit refuses this itself from 3.11.4 (and Debian's 3.11.2); 3.10's takes "[zz::1]" as a name
        raise UrlRefused(f"{what} {url!r} refused: {host!r} in brackets is not an IP address")
    if address is not None:
        refusal = policy.refusal(address)
        if refusal is not None:
            raise UrlRefused(f"{what} {url!r} refused: {refusal}")


def _resolve(host: str, port: int) -> list[tuple[Any, ...]]:
    return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)


def connect_checked(host: str, port: int, timeout: Any, source: Any, policy: UrlPolicy) -> socket.socket:
    """Resolve `host` once; refuse when any address it resolves to is refused; connect to those
    addresses in order (never resolving again)."""
    infos = _resolve(host, port)
    for info in infos:
        address = parse_address(str(info[4][0]))
        refusal = policy.refusal(address) if address is not None else f"{info[4][0]} is not an IP address"
        if refusal is not None:
            raise UrlRefused(f"download from {host} refused: {host} resolves to {refusal}")
    error: OSError = OSError(f"{host} resolves to no address")
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            if isinstance(timeout, (int, float)):
                sock.settimeout(timeout)
            if source:
                sock.bind(source)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    raise error


class _CheckedHTTP(http.client.HTTPConnection):
    url_policy = UrlPolicy()

    def connect(self) -> None:  # no proxy tunnel: these downloads connect directly
        source = getattr(self, "source_address", None)  # set by HTTPConnection, missing from its stubs
        self.sock = connect_checked(self.host, self.port, self.timeout, source, self.url_policy)


class _Handlers(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    def __init__(self, policy: UrlPolicy, context: ssl.SSLContext | None) -> None:
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self, context=context)

        class Plain(_CheckedHTTP):
            url_policy = policy

        # HTTPSConnection.connect wraps what Plain.connect opened (SNI and certificate: the host name).
        class Secure(http.client.HTTPSConnection, Plain):
            pass

        self.plain, self.secure, self.context = Plain, Secure, context

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self.plain, req)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self.secure, req, context=self.context)


class _Redirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, policy: UrlPolicy) -> None:
        self.policy = policy

    def http_error_302(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                       headers: Any) -> Any:  # fmt: skip
        # Before urllib looks at it: every Location is judged by the policy (and refused as such).
        location = headers.get("location") or headers.get("uri")
        if location:
            check_url(urllib.parse.urljoin(req.full_url, location), self.policy, redirect=True)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def checked_opener(policy: UrlPolicy, context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    """http(s) only, every connection checked, no proxies, no ftp/file/data handlers."""
    opener = urllib.request.OpenerDirector()
    for handler in (_Handlers(policy, context), _Redirects(policy), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor(), urllib.request.UnknownHandler()):  # fmt: skip
        opener.add_handler(handler)
    return opener
