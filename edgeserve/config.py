"""Appliance settings: a TOML file, then EDGESERVE_<SECTION>_<KEY> environment overrides, then CLI flags.

Validated once, at load; every error names the file, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from edgeserve.config_allowlist import only_allowed
from edgeserve.config_sections import (
    MAX_COMMAND_LIFETIME_S,
    MAX_SPIN_US,
    ConfigError,
    FleetSection,
    GrpcSection,
    HttpSection,
    LoggingSection,
    MetricsSection,
    OtaSection,
    RepositorySection,
    RuntimeSection,
    ServerSection,
    ShmSection,
    SupervisorSection,
    ZmqSection,
)
from edgeserve.protocol.restricted import RestrictedGroups, grpc_restrictions, http_restrictions

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The sections live in config_sections.py; importers keep using edgeserve.config.
__all__ = [
    "MAX_COMMAND_LIFETIME_S",
    "MAX_SPIN_US",
    "ConfigError",
    "FleetSection",
    "GrpcSection",
    "HttpSection",
    "LoggingSection",
    "MetricsSection",
    "OtaSection",
    "RepositorySection",
    "RuntimeSection",
    "ServerSection",
    "Settings",
    "ShmSection",
    "SupervisorSection",
    "ZmqSection",
    "load_settings",
    "load_settings_with_sources",
    "to_dict",
]


@dataclass
class Settings:
    server: ServerSection = field(default_factory=ServerSection)
    repository: RepositorySection = field(default_factory=RepositorySection)
    http: HttpSection = field(default_factory=HttpSection)
    grpc: GrpcSection = field(default_factory=GrpcSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    zmq: ZmqSection = field(default_factory=ZmqSection)
    shm: ShmSection = field(default_factory=ShmSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    supervisor: SupervisorSection = field(default_factory=SupervisorSection)
    ota: OtaSection = field(default_factory=OtaSection)
    fleet: FleetSection = field(default_factory=FleetSection)

    def validate(self, source: str) -> None:
        """Cross-field checks, after types are known good."""

        def fail(path: str, message: str) -> None:
            raise ConfigError(f"{source}: {path}: {message}")

        if self.server.model_control_mode not in ("explicit", "none"):
            fail(
                "server.model_control_mode",
                f"'{self.server.model_control_mode}' is not one of explicit, none",
            )
        if self.server.event_loop not in ("auto", "uvloop", "asyncio"):
            fail("server.event_loop", f"'{self.server.event_loop}' is not one of auto, uvloop, asyncio")
        for section, port in (("http", self.http.port), ("grpc", self.grpc.port)):
            if not 0 <= port <= 65535:
                fail(f"{section}.port", f"{port} is not a TCP port (0-65535; 0 picks a free one)")
        if not 0 <= self.metrics.port <= 65535 or not self.metrics.address.strip():
            fail("metrics.port", "port must be 0 (no metrics listener) or a TCP port, address a host or IP")
        self._validate_limits(fail)
        self._validate_listeners(fail)
        inline_limits = {"http": self.http.inline_max_us, "grpc": self.grpc.inline_max_us}
        inline_limits["zmq"] = self.zmq.inline_max_us
        for name, inline_us in inline_limits.items():
            if inline_us < 0:
                fail(f"{name}.inline_max_us", "must be 0 (always hand requests to a worker) or a time in µs")
        if self.shm.registration not in ("peer-credentials", "triton"):
            fail("shm.registration", f"'{self.shm.registration}' is not one of peer-credentials, triton")
        if not 0 <= self.zmq.spin_us <= MAX_SPIN_US:
            fail("zmq.spin_us", f"must be 0 (never spin) up to {MAX_SPIN_US} µs")
        if self.runtime.cpu_threads < 0:
            fail("runtime.cpu_threads", "must be 0 (auto) or a positive thread count")
        if self.runtime.openvino_performance_hint not in ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"):
            fail("runtime.openvino_performance_hint", "use LATENCY, THROUGHPUT or CUMULATIVE_THROUGHPUT")
        if self.runtime.memory_profile not in ("auto", "small", "standard"):
            profile = self.runtime.memory_profile
            fail("runtime.memory_profile", f"'{profile}' is not one of auto, small, standard")
        if not 0 <= self.runtime.race_budget_s <= 600:
            fail("runtime.race_budget_s", "must be 0 (no race: the profile order decides) up to 600 seconds")
        unknown = set(self.runtime.allowed_precisions) - {"fp32", "fp16", "bf16", "int8"}
        if unknown:
            fail(
                "runtime.allowed_precisions",
                f"unknown precision(s) {sorted(unknown)}; use fp32, fp16, bf16, int8",
            )
        if self.logging.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            fail("logging.level", f"'{self.logging.level}' is not DEBUG, INFO, WARNING or ERROR")
        if self.logging.format not in ("text", "json"):
            fail("logging.format", "use text or json")
        if self.logging.max_bytes < 4096:
            fail("logging.max_bytes", "must be at least 4096 (bytes per log file before it rotates)")
        if self.logging.backups < 1:
            fail("logging.backups", "must be at least 1 (rotated files kept)")
        sup = self.supervisor
        for name in ("restart_initial_s", "restart_max_s", "stable_after_s", "health_interval_s"):
            if getattr(sup, name) <= 0:
                fail(f"supervisor.{name}", "must be a positive number of seconds")
        if sup.restart_max_s < sup.restart_initial_s:
            fail("supervisor.restart_max_s", f"must be at least restart_initial_s ({sup.restart_initial_s})")
        if not 0 < sup.health_timeout_s <= 60:
            fail("supervisor.health_timeout_s", "must be between 0 and 60 seconds")
        if sup.hang_timeout_s < 0:
            fail("supervisor.hang_timeout_s", "must be 0 (never) or a number of seconds")
        if sup.max_rss_mb < 0:
            fail("supervisor.max_rss_mb", "must be 0 (off) or a size in MB")
        for name in ("trial_window_s", "load_timeout_s"):
            if getattr(self.ota, name) <= 0:
                fail(f"ota.{name}", "must be a positive number of seconds")
        if self.ota.trial_memory_mb < 0:
            fail("ota.trial_memory_mb", "must be 0 (measure) or a size in MB")
        if self.ota.max_unpacked_mb <= 0:
            fail("ota.max_unpacked_mb", "must be a positive size in MB")
        if self.ota.crash_rollback_restarts < 0:
            fail("ota.crash_rollback_restarts", "must be 0 (never roll back on crashes) or a count")
        if self.ota.trust_dir is not None and not self.ota.trust_dir.is_absolute():
            fail(
                "ota.trust_dir",
                f"'{self.ota.trust_dir}' must be an absolute path (e.g. /etc/edgeserve/trust)",
            )
        self._validate_fleet(fail)
        if self.server.exit_timeout_s < 0:
            fail("server.exit_timeout_s", "must be 0 or a number of seconds")

    def _validate_limits(self, fail: Any) -> None:
        for path, value in (
            ("http.max_input_bytes", self.http.max_input_bytes),
            ("grpc.max_message_bytes", self.grpc.max_message_bytes),
            ("zmq.max_message_bytes", self.zmq.max_message_bytes),
        ):
            if value < 0:
                fail(path, "must be 0 (sized for the device) or a size in bytes")
            elif 0 < value < 4096:
                fail(path, f"{value} bytes is too small for any request; use 0 (sized for the device)")
        if self.server.max_inflight < 0:
            fail("server.max_inflight", "must be 0 (sized from the model queues) or a count of requests")
        if self.server.cache_mb < 0:
            fail("server.cache_mb", "must be 0 (no response cache) or a size in MB")
        if self.repository.memory_budget_mb < 0 or self.repository.load_wait_s <= 0:
            fail("repository", "memory_budget_mb must be 0 (the device's) or MB; load_wait_s a positive time")
        load_files, load_file = self.repository.load_files_max_bytes, self.repository.load_file_max_bytes
        if load_file < 1 or load_files < load_file:
            fail("repository.load_file_max_bytes", f"{load_file} must be a positive size in bytes, at "
                 f"most load_files_max_bytes ({load_files}), the limit for a whole load request")  # fmt: skip
        if self.grpc.max_message_bytes > 2**31 - 1:
            fail("grpc.max_message_bytes", f"must be at most {2**31 - 1} (gRPC's limit)")
        for path, count in (
            ("http.max_connections", self.http.max_connections),
            ("http.max_connections_per_client", self.http.max_connections_per_client),
            ("grpc.max_concurrent_rpcs", self.grpc.max_concurrent_rpcs),
            ("zmq.max_clients", self.zmq.max_clients),
        ):
            if count < 1:
                fail(path, "must be at least 1")
        for path, seconds in (
            ("http.header_timeout_s", self.http.header_timeout_s),
            ("http.keepalive_timeout_s", self.http.keepalive_timeout_s),
            ("grpc.keepalive_s", self.grpc.keepalive_s),
        ):
            if seconds <= 0:
                fail(path, "must be a positive number of seconds")
        for path, seconds in (
            ("grpc.stream_idle_timeout_s", self.grpc.stream_idle_timeout_s),
            ("grpc.connection_idle_timeout_s", self.grpc.connection_idle_timeout_s),
        ):
            if seconds < 0:
                fail(path, "must be 0 (never) or a number of seconds")

    def _validate_listeners(self, fail: Any) -> None:
        """[http] and [grpc] access: TLS files, the bearer token, Triton's restricted-API groups."""
        for section, values in (("http", self.http), ("grpc", self.grpc)):
            if bool(values.tls_cert) != bool(values.tls_key):
                fail(f"{section}.tls_cert", "tls_cert and tls_key must be set together")
            if values.tls_client_ca and not values.tls_cert:
                fail(f"{section}.tls_client_ca", "client certificates need TLS: set tls_cert and tls_key")
            for name in ("tls_cert", "tls_key", "tls_client_ca"):
                path = getattr(values, name)
                if path is not None and not Path(path).is_file():
                    fail(f"{section}.{name}", f"{path} is not a readable file (a PEM file)")
            token = values.token
            if token and (token != token.strip() or not token.isprintable() or " " in token
                          or not token.isascii()):  # fmt: skip
                fail(f"{section}.token", "must be printable ASCII without spaces (it travels in a header)")
            groups_field = "restricted_api" if section == "http" else "restricted_protocol"
            try:
                (http_restrictions if section == "http" else grpc_restrictions)(getattr(values, groups_field))
            except ValueError as exc:
                fail(f"{section}.{groups_field}", str(exc))

    def _validate_fleet(self, fail: Any) -> None:
        fleet = self.fleet
        if fleet.broker and not re.match(r"^mqtts?://[^/:]+(:\d+)?/?$", fleet.broker):
            fail("fleet.broker", f"'{fleet.broker}' is not mqtt://host[:port] or mqtts://host[:port]")
        aws = fleet.protocol == "aws-iot-jobs"
        for name in ("fleet", "device_id"):
            value = getattr(fleet, name)
            if name == "device_id" and aws:  # the AWS IoT thing name (as edgeserve.fleet.aws_jobs.THING_RE)
                if value and not re.match(r"^[A-Za-z0-9:_-]{1,128}$", value):
                    fail("fleet.device_id", f"'{value}' is not an AWS IoT thing name: 1-128 letters, digits, "
                         "':', '_', '-' (no '.')")  # fmt: skip
            elif value and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", value):
                fail(f"fleet.{name}", f"'{value}' must be letters, digits, '.', '_', '-' (one topic level)")
        if fleet.device_id == "manager":  # es/v1/{fleet}/manager/... is the fleet tools' inbox namespace
            fail("fleet.device_id", "'manager' is reserved for the fleet tools' inboxes; name the device")
        if fleet.protocol not in ("5", "3.1.1", "aws-iot-jobs"):
            fail("fleet.protocol", f"'{fleet.protocol}' is not 5, 3.1.1 (MQTT versions) or aws-iot-jobs")
        if bool(fleet.cert_file) != bool(fleet.key_file):
            fail("fleet.cert_file", "cert_file and key_file must be set together")
        if fleet.keepalive_s < 5 or fleet.metrics_interval_s <= 0 or fleet.max_queued_commands < 0:
            fail("fleet.keepalive_s", "keepalive_s >= 5, metrics_interval_s > 0, max_queued_commands >= 0")
        if not 0 < fleet.max_command_lifetime_s <= MAX_COMMAND_LIFETIME_S:
            fail("fleet.max_command_lifetime_s", f"must be more than 0 and at most {MAX_COMMAND_LIFETIME_S} "
                 "seconds (30 days); the default is 86400 (a day)")  # fmt: skip
        if fleet.command_keys is not None and fleet.command_keys.exists() and not fleet.command_keys.is_dir():
            fail("fleet.command_keys", f"'{fleet.command_keys}' is a file; give the folder that holds the "
                 "trusted command keys, one *.pub per key")  # fmt: skip


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check/convert a TOML or env value to the field's annotated type."""
    if annotation is RestrictedGroups:
        try:
            return RestrictedGroups.from_setting(value, where)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is not None and type(None) in args:  # Optional[X]
        if value is None or value == "":
            return None
        inner = next(a for a in args if a is not type(None))
        return _coerce(value, inner, where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if annotation is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if annotation is Path:
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{where}: expected a path string, got {value!r}")
        return Path(value)
    if origin is list:
        if isinstance(value, str):  # env form: comma-separated
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{where}: unsupported setting type {annotation}")  # pragma: no cover


def _apply(
    settings: Settings, data: Mapping[str, Any], source: str, sources: dict[str, str] | None = None
) -> None:
    section_types = get_type_hints(Settings)
    for section_name, section_values in data.items():
        if section_name not in section_types:
            raise ConfigError(
                f"{source}: [{section_name}]: unknown section{_did_you_mean(section_name, section_types)}"
            )
        if not isinstance(section_values, Mapping):
            raise ConfigError(f"{source}: [{section_name}] must be a table")
        section = getattr(settings, section_name)
        hints = get_type_hints(type(section))
        for key, value in section_values.items():
            if key not in hints:
                hint = _did_you_mean(key, hints)
                raise ConfigError(f"{source}: {section_name}.{key}: unknown setting{hint}")
            setattr(section, key, _coerce(value, hints[key], f"{source}: {section_name}.{key}"))
            if sources is not None:
                sources[f"{section_name}.{key}"] = source


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    names = list(known)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint}; known: {', '.join(names)}"


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    overrides: dict[str, dict[str, str]] = {}
    sections = {f.name for f in fields(Settings)}
    for name, value in environ.items():
        if not name.startswith("EDGESERVE_"):
            continue
        rest = name[len("EDGESERVE_") :].lower()
        section, _, key = rest.partition("_")
        if section in sections and key:
            overrides.setdefault(section, {})[key] = value
    return overrides


def load_settings(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """File, then environment, then explicit overrides (CLI flags); validated once."""
    return load_settings_with_sources(path, environ, overrides)[0]


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)
            return data
    except FileNotFoundError:
        raise ConfigError(f"{path}: settings file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_settings_with_sources(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    overlay: Path | None = None,
) -> tuple[Settings, dict[str, str]]:
    """As `load_settings`, plus where each non-default value came from ("section.key" -> source).
    `overlay`: a second file over the first (what the fleet manager set), under env and flags."""
    settings = Settings()
    sources: dict[str, str] = {}
    if path is not None:
        _apply(settings, _read_toml(path), str(path), sources)
    if overlay is not None:  # only what a fleet command may set: a key put there otherwise is dropped
        _apply(settings, only_allowed(_read_toml(overlay), str(overlay)), str(overlay), sources)
    env = os.environ if environ is None else environ
    env_values = _env_overrides(env)
    if env_values:
        _apply(settings, env_values, "environment (EDGESERVE_*)", sources)
    if overrides:
        _apply(settings, {k: dict(v) for k, v in overrides.items() if v}, "command line", sources)
    settings.validate(str(path) if path else "settings")
    return settings, sources


def to_dict(settings: Settings) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return {k: {kk: plain(vv) for kk, vv in v.items()} for k, v in dataclasses.asdict(settings).items()}
