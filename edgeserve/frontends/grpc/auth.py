"""The gRPC side of frontends/access.py: the peer of a call, its metadata, TLS credentials.

The policy itself (token, admin RPCs from loopback only, Triton's restricted protocols) is shared with
HTTP; this module only reads a `grpc.aio.ServicerContext` for it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import grpc

from edgeserve.config import GrpcSection
from edgeserve.frontends.access import (
    AccessPolicy,
    Endpoint,
    bearer,
    exposure_warnings,
    is_loopback_address,
    is_loopback_bind,
    read_tls_files,
)

__all__ = ["AccessPolicy", "GrpcPeer", "bearer_token", "is_loopback_bind", "is_loopback_peer"]

log = logging.getLogger("edgeserve.grpc")


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
    return host is not None and is_loopback_address(host)


def metadata_value(metadata: Iterable[Any] | None, key: str) -> str | None:
    for item in metadata or ():
        if item[0] == key:
            value = item[1]
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


def bearer_token(metadata: Iterable[Any] | None) -> str | None:
    return bearer(metadata_value(metadata, "authorization"))


class GrpcPeer:
    __slots__ = ("context",)

    def __init__(self, context: Any) -> None:
        self.context = context

    def loopback(self) -> bool:
        return is_loopback_peer(self.context.peer() or "")

    def private(self) -> bool:
        return False  # the supervisor's private door is HTTP on a Unix socket

    def header(self, name: str) -> str | None:
        return metadata_value(self.context.invocation_metadata(), name)


def check(policy: AccessPolicy, context: Any, endpoint: Endpoint | None) -> None:
    """Raises the policy's InferenceError for this call."""
    if policy.needs_check(endpoint):
        policy.check(endpoint, GrpcPeer(context))


def server_credentials(settings: GrpcSection) -> grpc.ServerCredentials | None:
    """TLS credentials when `tls_cert`/`tls_key` are set; mutual TLS when `tls_client_ca` is set too."""
    if not settings.tls_cert or not settings.tls_key:
        return None
    cert, key, client_ca = read_tls_files("grpc", settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def warn_about_exposure(settings: GrpcSection, secure: bool) -> None:
    for warning in exposure_warnings(
        "grpc", settings.host, settings.token, secure, bool(settings.tls_client_ca)
    ):
        log.warning("%s", warning)
