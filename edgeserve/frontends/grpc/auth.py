"""Who may call what: loopback detection, the bearer token for remote peers, admin RPCs, TLS credentials.

- Loopback peers (127.0.0.0/8, ::1, IPv4-mapped loopback, Unix sockets) are trusted: camera pipelines
  on the box and the supervisor talk to the server that way.
- When `grpc.token` is set, every other peer must send `authorization: Bearer <token>` metadata.
- With `grpc.admin_loopback_only`, admin RPCs (load/unload, shm register/unregister, log settings
  updates) are refused to non-loopback peers whatever their token.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from edgeserve.config import GrpcSection
from edgeserve.protocol.errors import InferenceError, Status

log = logging.getLogger("edgeserve.grpc")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def peer_host(peer: str) -> str | None:
    """The address part of a gRPC peer string ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000'); None for
    Unix sockets and unknown forms."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return None


@functools.lru_cache(maxsize=4096)
def is_loopback_peer(peer: str) -> bool:
    if peer.startswith(("unix:", "unix-abstract:")):
        return True
    host = peer_host(peer)
    if host is None:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def is_loopback_bind(host: str) -> bool:
    if host.startswith(("unix:", "unix-abstract:")) or host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_token(metadata: Iterable[Any] | None) -> str | None:
    for item in metadata or ():
        key, value = item[0], item[1]
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
            return None
    return None


class AccessPolicy:
    def __init__(self, token: str = "", admin_loopback_only: bool = True) -> None:
        self._token = token.encode()
        self.admin_loopback_only = admin_loopback_only

    def check(self, context: grpc.aio.ServicerContext[Any, Any], admin: bool) -> None:
        """Raises UNAUTHENTICATED / PERMISSION_DENIED; loopback peers always pass."""
        if not self._token and not (admin and self.admin_loopback_only):
            return  # nothing to check: keep the inference path free of peer parsing
        if is_loopback_peer(context.peer() or ""):
            return
        if self._token:
            sent = bearer_token(context.invocation_metadata())
            if sent is None or not hmac.compare_digest(sent.encode(), self._token):
                raise InferenceError(
                    Status.UNAUTHENTICATED,
                    "missing or wrong bearer token: send 'authorization: Bearer <token>' metadata",
                )
        if admin and self.admin_loopback_only:
            raise InferenceError(
                Status.PERMISSION_DENIED,
                "this RPC is allowed only from the appliance itself (loopback); "
                "set [grpc] admin_loopback_only = false to allow it remotely",
            )


def server_credentials(settings: GrpcSection) -> grpc.ServerCredentials | None:
    """TLS credentials when `tls_cert`/`tls_key` are set; mutual TLS when `tls_client_ca` is set too."""
    if not settings.tls_cert or not settings.tls_key:
        return None
    key = Path(settings.tls_key).read_bytes()
    cert = Path(settings.tls_cert).read_bytes()
    client_ca = Path(settings.tls_client_ca).read_bytes() if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def warn_about_exposure(settings: GrpcSection, secure: bool) -> None:
    if is_loopback_bind(settings.host):
        return
    if not settings.token and not secure:
        log.warning(
            "grpc listens on %s without TLS and without a token: anyone on the network can run "
            "inference (set [grpc] token and tls_cert/tls_key)",
            settings.host,
        )
    elif settings.token and not secure:
        log.warning("grpc token is sent in clear text on %s: set [grpc] tls_cert/tls_key", settings.host)
