"""What a fleet `set_config` may change: tuning, never trust.

A command from the fleet may tune limits, queues, batching and which models load. It may never move
or open a listener, touch TLS, tokens or the admin rules, turn on a restricted API, name a path or a
file (a log file in the key folder is a key), or change the `[fleet]` and `[ota]` sections (the
broker, the trust folders, the bundle policy). Anything not in ALLOWED is refused, so a setting added
later is refused until someone decides otherwise; REFUSED only says why (tests/security checks that
every setting is in one of the two tables and that the docs list ALLOWED).

The same rule holds for the overlay the agent persisted (`<state_dir>/fleet/settings.toml`): a key
outside ALLOWED in it (written by an older version, or by hand) is dropped at load with a warning.
Loading enforces it (config.py), so it lives with the settings; the fleet agent and the supervisor
ask it too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from edgeserve.logs import safe

log = logging.getLogger("edgeserve.fleet")

# "section.key" -> what it tunes (the docs table is made from this).
ALLOWED: dict[str, str] = {
    "logging.level": "log verbosity: DEBUG, INFO, WARNING, ERROR",
    "logging.format": "log line format: text or json",
    "server.load_models": "which models load (activate_model / deactivate_model write it too)",
    "server.max_inflight": "inference requests in flight at once, all frontends",
    "server.cache_mb": "response cache bound in MB",
    "repository.memory_budget_mb": "memory the models may hold together",
    "repository.load_wait_s": "how long a request waits for a model loading on first use",
    "repository.load_files_max_bytes": "bytes of files one load request may send in all",
    "repository.load_file_max_bytes": "bytes of one file sent with a load request",
    "http.max_input_bytes": "request body limit",
    "http.max_connections": "open HTTP connections in all",
    "http.max_connections_per_client": "open HTTP connections per peer",
    "http.header_timeout_s": "time for a request's headers (slow clients)",
    "http.keepalive_timeout_s": "idle keep-alive connection lifetime",
    "http.inline_max_us": "scheduling: run short requests on the event loop",
    "grpc.max_message_bytes": "gRPC message limit",
    "grpc.max_concurrent_rpcs": "gRPC calls at once",
    "grpc.stream_idle_timeout_s": "idle ModelStreamInfer stream lifetime",
    "grpc.connection_idle_timeout_s": "idle gRPC connection lifetime",
    "grpc.keepalive_s": "gRPC keepalive ping period",
    "grpc.inline_max_us": "scheduling: run short requests on the event loop",
    "zmq.max_inflight_per_client": "ZeroMQ requests in flight per client",
    "zmq.max_message_bytes": "ZeroMQ request limit",
    "zmq.max_clients": "ZeroMQ clients known at once",
    "zmq.inline_max_us": "scheduling: run short requests on the ZeroMQ thread",
    "zmq.spin_us": "scheduling: poll before sleeping",
    "shm.max_regions": "shared-memory regions registered at once",
    "runtime.cpu_threads": "runtime threads",
    "runtime.default_max_batch_size": "batching: max batch size of auto-completed models",
    "runtime.ort_memory_arena": "ONNX Runtime memory arena",
    "runtime.ort_allow_spinning": "ONNX Runtime spinning threads",
    "runtime.openvino_performance_hint": "OpenVINO LATENCY / THROUGHPUT hint",
    "runtime.memory_profile": "runtime memory settings (small board / standard)",
    "runtime.race_budget_s": "time to race runtimes per model at load",
    "runtime.race_background": "finish a race the load budget cut short while the model serves",
    "runtime.race_max_batch_size": "batching: largest batch size raced where a config leaves it open",
}

# Why the others are refused ("section.*" covers a whole section).
LISTENER, CREDENTIAL, ACCESS, PATH = "listener", "TLS or credential", "access rule or restricted API", "path"
REFUSED: dict[str, str] = {
    "fleet.*": "the [fleet] section (broker, identity, command keys) is local only",
    "ota.*": "the [ota] section (trust folder, bundle policy) is local only",
    "supervisor.*": "the supervisor's self-healing is local policy",
    "server.model_repository": PATH,
    "server.state_dir": PATH,
    "server.model_control_mode": ACCESS,
    "server.strict_readiness": "health semantics are local policy",
    "server.exit_timeout_s": "tied to the unit's TimeoutStopSec=, local",
    "server.event_loop": "which code serves is local",
    "http.enabled": LISTENER,
    "http.host": LISTENER,
    "http.port": LISTENER,
    "grpc.enabled": LISTENER,
    "grpc.host": LISTENER,
    "grpc.port": LISTENER,
    "grpc.tls_cert": CREDENTIAL,
    "grpc.tls_key": CREDENTIAL,
    "grpc.tls_client_ca": CREDENTIAL,
    "grpc.token": CREDENTIAL,
    "grpc.admin_loopback_only": ACCESS,
    "grpc.restricted_protocol": ACCESS,
    "http.tls_cert": CREDENTIAL,
    "http.tls_key": CREDENTIAL,
    "http.tls_client_ca": CREDENTIAL,
    "http.token": CREDENTIAL,
    "http.admin_loopback_only": ACCESS,
    "http.restricted_api": ACCESS,
    "metrics.port": LISTENER,
    "metrics.address": LISTENER,
    "zmq.enabled": LISTENER,
    "zmq.endpoints": LISTENER,
    "shm.allow_client_shm": ACCESS,
    "shm.key_prefixes": ACCESS,
    "shm.registration": ACCESS,
    "runtime.allowed_precisions": "result accuracy is local policy",
    "runtime.accuracy_tolerance": "result accuracy is local policy",
    "runtime.cache_dir": PATH,
    "runtime.device_profiles": PATH,
    "runtime.hardware_root": PATH,
    "logging.file": PATH,
    "logging.max_bytes": "log retention is local (a tiny one erases evidence)",
    "logging.backups": "log retention is local (a tiny one erases evidence)",
}


def why_refused(name: str) -> str | None:
    """None when a command may set `name` ("section.key"), else the reason."""
    if name in ALLOWED:
        return None
    section = name.split(".", 1)[0]
    return REFUSED.get(name) or REFUSED.get(f"{section}.*") or "not on the set_config allowlist"


def refused_keys(changes: Mapping[str, Any]) -> list[str]:
    """Every "section.key (why)" of `{section: {key: value}}` that a command may not set, sorted."""
    refused: list[str] = []
    for section, values in changes.items():
        keys = values if isinstance(values, Mapping) else {"*": None}
        for key in keys:
            reason = why_refused(f"{section}.{key}")
            if reason is not None:  # names from the wire: escaped and bounded, also in the answer
                refused.append(f"{safe(section, 40)}.{safe(key, 60)} ({reason})")
    return sorted(refused)


def only_allowed(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The overlay without what a command may not set; what was dropped is logged."""
    kept: dict[str, Any] = {}
    for section, values in data.items():
        if not isinstance(values, Mapping):
            continue
        allowed = {k: v for k, v in values.items() if f"{section}.{k}" in ALLOWED}
        if allowed:
            kept[section] = allowed
    dropped = refused_keys(data)
    if dropped:
        log.warning("%s: ignored, a fleet command may not set: %s", source, safe(", ".join(dropped), 600))
    return kept
