"""Who may call what, the same on HTTP and gRPC: each frontend only names the endpoint and its peer.

In this order, for one request:
1. Bearer token (`token`): a non-loopback peer must send `authorization: Bearer <token>` (HTTP header
   or gRPC metadata), compared in constant time; else UNAUTHENTICATED (HTTP 401). Loopback peers
   (127.0.0.0/8, ::1, IPv4-mapped loopback, Unix sockets) never need it: camera pipelines and the
   supervisor on the box. Server liveness/readiness probes never need it either (they tell only up or
   down; load balancers and probes cannot send tokens), as Triton's health endpoints.
2. Admin endpoints (load/unload, shared-memory register/unregister, log-settings updates) are refused
   to non-loopback peers while `admin_loopback_only` (the default), token or not: PERMISSION_DENIED
   (HTTP 403).
3. Triton's restricted APIs (protocol/restricted.py): a restricted category needs its header from every peer,
   loopback included (Triton: HTTP 403, gRPC UNAVAILABLE). The one exception is the supervisor's
   private control socket (a Unix socket of mode 0600: only the service's own user can open it, and
   that user can read the settings that hold the header anyway).
Forwarding headers (X-Forwarded-For) are never trusted: a reverse proxy on the box is a loopback peer.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.restricted import Restriction, grpc_restrictions, http_restrictions

if TYPE_CHECKING:
    from edgeserve.config import GrpcSection, HttpSection

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class Endpoint:
    """What a request does, whatever the wire."""

    category: str  # Triton's restricted-API category ("" = none, e.g. /metrics)
    name: str  # for messages
    admin: bool = False  # changes what the server runs or maps: loopback peers only by default
    probe: bool = False  # server liveness/readiness: answered without the token


SERVER_HEALTH = Endpoint("health", "server health", probe=True)
MODEL_READY = Endpoint("health", "model readiness")
METADATA = Endpoint("metadata", "metadata")
INFERENCE = Endpoint("inference", "inference")
MODEL_CONFIG = Endpoint("model-config", "model configuration")
STATISTICS = Endpoint("statistics", "statistics")
REPOSITORY_INDEX = Endpoint("model-repository", "repository index")
MODEL_CONTROL = Endpoint("model-repository", "model load/unload", admin=True)
SHM_STATUS = Endpoint("shared-memory", "shared memory status")
SHM_CONTROL = Endpoint("shared-memory", "shared memory register/unregister", admin=True)
TRACE = Endpoint("trace", "trace settings")
LOG_READ = Endpoint("logging", "log settings")
LOG_UPDATE = Endpoint("logging", "log settings update", admin=True)
METRICS = Endpoint("", "metrics")


class Peer(Protocol):
    """The caller of one request, as its frontend sees it."""

    def loopback(self) -> bool: ...  # on the appliance itself

    def private(self) -> bool: ...  # the supervisor's control socket

    def header(self, name: str) -> str | None: ...  # a request header / metadata value


class RestrictedError(InferenceError):
    """A restricted API called without its header: Triton answers HTTP 403 and gRPC UNAVAILABLE."""

    def __init__(self, message: str) -> None:
        super().__init__(Status.UNAVAILABLE, message)

    @property
    def http_status(self) -> int:
        return 403


@functools.lru_cache(maxsize=4096)
def is_loopback_address(host: str) -> bool:
    """An IP address string (an IPv6 zone and IPv4-mapped forms allowed) on the loopback network."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def is_loopback_bind(host: str) -> bool:
    """A listen address that only this box can reach ("" and 0.0.0.0 are every interface)."""
    if host.startswith(("unix:", "unix-abstract:")) or host in LOOPBACK_HOSTS:
        return True
    return bool(host) and is_loopback_address(host.strip("[]"))


def bearer(value: str | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value (scheme case-insensitive)."""
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class AccessPolicy:
    def __init__(
        self,
        frontend: str,
        token: str = "",
        admin_loopback_only: bool = True,
        restricted: Mapping[str, Restriction] | None = None,
    ) -> None:
        self.frontend = frontend  # "http" | "grpc": the settings section messages point to
        self._token = token.encode()
        self.admin_loopback_only = admin_loopback_only
        self.restricted = dict(restricted or {})
        self._feature = "protocol" if frontend == "grpc" else "API"

    @classmethod
    def from_settings(cls, frontend: str, section: HttpSection | GrpcSection) -> AccessPolicy:
        """The policy of validated settings ([http] or [grpc])."""
        groups = getattr(section, "restricted_api" if frontend == "http" else "restricted_protocol")
        table = (http_restrictions if frontend == "http" else grpc_restrictions)(groups)
        return cls(frontend, section.token, section.admin_loopback_only, table)

    def needs_check(self, endpoint: Endpoint | None) -> bool:
        """False when `check` could refuse nobody for this endpoint (the hot path skips it)."""
        if endpoint is None:
            return bool(self._token)
        return (
            bool(self._token and not endpoint.probe)
            or (endpoint.admin and self.admin_loopback_only)
            or endpoint.category in self.restricted
        )

    def check(self, endpoint: Endpoint | None, peer: Peer) -> None:
        """Raises UNAUTHENTICATED, PERMISSION_DENIED or RestrictedError (`endpoint` None: a request that
        names no known endpoint, e.g. an unknown path: only the token applies)."""
        local: bool | None = None
        if self._token and not (endpoint is not None and endpoint.probe):
            local = peer.loopback()
            if not local:
                sent = bearer(peer.header("authorization"))
                # errors="replace": a header of undecodable bytes is a wrong token, not an error
                if sent is None or not hmac.compare_digest(sent.encode(errors="replace"), self._token):
                    raise InferenceError(Status.UNAUTHENTICATED, self._token_message())
        if endpoint is None:
            return
        if endpoint.admin and self.admin_loopback_only and not (peer.loopback() if local is None else local):
            raise InferenceError(
                Status.PERMISSION_DENIED,
                f"{endpoint.name} is allowed only from the appliance itself (loopback); set "
                f"[{self.frontend}] admin_loopback_only = false to allow it from the network",
            )
        restriction = self.restricted.get(endpoint.category)
        if restriction is not None and not peer.private():
            sent_value = peer.header(restriction.header)
            if sent_value is None or not hmac.compare_digest(
                sent_value.encode(errors="replace"), restriction.value.encode()
            ):
                raise RestrictedError(
                    f"This {self._feature} is restricted, expecting header '{restriction.header}'"
                )

    def _token_message(self) -> str:
        sent = "header 'Authorization" if self.frontend == "http" else "metadata 'authorization"
        return (
            f"missing or wrong bearer token: send the {sent}: Bearer <token>' ([{self.frontend}] token), "
            "or call from the appliance itself"
        )


def read_tls_files(
    section: str, cert: Path, key: Path, client_ca: Path | None
) -> tuple[bytes, bytes, bytes | None]:
    """PEM bytes of [section] tls_cert / tls_key / tls_client_ca; OSError naming the setting."""
    loaded: list[bytes | None] = []
    for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_client_ca", client_ca)):
        try:
            loaded.append(None if path is None else Path(path).read_bytes())
        except OSError as exc:
            raise OSError(f"[{section}] {name} {path}: {exc.strerror or exc}") from None
    cert_pem, key_pem, ca_pem = loaded
    assert cert_pem is not None and key_pem is not None
    return cert_pem, key_pem, ca_pem


def exposure_warnings(section: str, host: str, token: str, tls: bool, client_ca: bool) -> list[str]:
    """What a listener on `host` leaves open to the network (nothing when it is bound to loopback)."""
    if is_loopback_bind(host):
        return []
    where = f"[{section}] host = {host!r} listens beyond loopback"
    warnings: list[str] = []
    if not token and not client_ca:
        warnings.append(
            f"{where} with no token and no client certificates: anyone on the network can run "
            f"inference and read metadata (set [{section}] token, or tls_client_ca)"
        )
    if not tls:
        secret = "the bearer token and " if token else ""
        warnings.append(
            f"{where} without TLS: {secret}tensors travel in clear text "
            f"(set [{section}] tls_cert and tls_key)"
        )
    return warnings
