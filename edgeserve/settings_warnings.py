"""`edgeserve config check` warnings: settings that are valid but risky.

Each concern is one function `Settings -> list[str]` in CHECKS; add yours there. A warning says what is
exposed and the setting that fixes it. Light imports: the supervisor may use it too.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from edgeserve.config import Settings
from edgeserve.frontends.access import exposure_warnings, is_loopback_bind

MIN_TOKEN_CHARS = 16
# ZeroMQ transports that stay on this box
_LOCAL_ZMQ = ("ipc://", "inproc://")


def listener_warnings(settings: Settings) -> list[str]:
    """HTTP and gRPC reachable from the network without authentication or TLS, or with admin open."""
    warnings: list[str] = []
    for name, section in (("http", settings.http), ("grpc", settings.grpc)):
        if not section.enabled:
            continue
        tls = bool(section.tls_cert and section.tls_key)
        warnings += exposure_warnings(name, section.host, section.token, tls, bool(section.tls_client_ca))
        if is_loopback_bind(section.host):
            continue  # only the box can call it: the rest cannot be reached from the network
        if not section.admin_loopback_only:
            warnings.append(
                f"[{name}] admin_loopback_only = false on {section.host!r}: network peers"
                f"{' with the token' if section.token else ''} can load and unload models, register "
                "shared memory and change log settings (set it to true)"
            )
        if section.token and len(section.token) < MIN_TOKEN_CHARS:
            warnings.append(
                f"[{name}] token is {len(section.token)} characters: guessable over the network "
                f"(use at least {MIN_TOKEN_CHARS} random ones, e.g. `openssl rand -hex 32`)"
            )
    return warnings


def zmq_host(endpoint: str) -> str | None:
    """The interface a ZeroMQ endpoint binds to ("*" = all; None: a transport that stays on this box)."""
    if endpoint.startswith(_LOCAL_ZMQ):
        return None
    address = endpoint.partition("://")[2].rpartition(";")[2]  # "source;address": the address
    if address.startswith("["):  # [IPv6]:port
        return address[1 : address.find("]")] if "]" in address else address
    return address.rpartition(":")[0] or address


def zmq_warnings(settings: Settings) -> list[str]:
    """ZeroMQ has no authentication or encryption here: a tcp:// endpoint beyond loopback is open."""
    if not settings.zmq.enabled:
        return []
    warnings: list[str] = []
    for endpoint in settings.zmq.endpoints:
        host = zmq_host(endpoint)
        if host is None or host == "lo" or is_loopback_bind(host):
            continue
        warnings.append(
            f"[zmq] endpoint {endpoint!r} listens beyond loopback: ZeroMQ requests carry no token and "
            "no TLS, so anyone on the network can run inference (use ipc:// or tcp://127.0.0.1)"
        )
    return warnings


def fleet_warnings(settings: Settings) -> list[str]:
    """A broker credential (or a mis-set ACL) should never be enough to command the device."""
    fleet = settings.fleet
    if not fleet.broker:
        return []
    warnings: list[str] = []
    if not fleet.require_signed_commands:
        warnings.append(
            "[fleet] require_signed_commands = false: anyone who can publish on this device's command "
            "topics can deploy bundles, roll back and change settings (a lab setting; set it to true and "
            "put the fleet's command keys in the command_keys folder)"
        )
    host = urlsplit(fleet.broker).hostname or ""
    if fleet.broker.startswith("mqtt://") and not (host == "localhost" or is_loopback_bind(host)):
        warnings.append(
            f"[fleet] broker {fleet.broker!r} is reached without TLS: the network path can read telemetry "
            "and drop commands (signed commands still cannot be forged); use mqtts://"
        )
    return warnings


def ota_warnings(settings: Settings) -> list[str]:
    """Fleet-initiated downloads that may reach this box's own files or services."""
    allowed = {
        "allow_file_urls": "local files (file:// and paths)",
        "allow_loopback_urls": "this box's loopback services",
        "allow_link_local_urls": "link-local addresses, cloud metadata (169.254.169.254) included",
    }
    return [
        f"[ota] {name} = true: a fleet deploy may make the device fetch {what} (a lab setting)"
        for name, what in allowed.items()
        if getattr(settings.ota, name)
    ]


CHECKS: list[Callable[[Settings], list[str]]] = [
    listener_warnings,
    zmq_warnings,
    fleet_warnings,
    ota_warnings,
]


def risky_settings(settings: Settings) -> list[str]:
    """Every warning, in CHECKS order."""
    return [warning for check in CHECKS for warning in check(settings)]
