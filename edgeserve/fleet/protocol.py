"""The fleet's MQTT surface (fixed: any fleet manager speaks it): topics under
`es/v1/{fleet}/{device}/`, the command envelope, the verbs and their arguments, the answer statuses.

    state          device ->  QoS 1, retained: {online, boot_id, version, at}; the will: online false
    info           device ->  QoS 1, retained: hardware, backends, bundles; sent at every connect
    desired        -> device  QoS 1, retained by the manager: {generation, bundle: {url, sha256?}}
    reported       device ->  QoS 1, retained: {generation, active_version, previous_version, ...}
    cmd/{verb}     -> device  QoS 1, never retained: {cmd_id, issued_at, expires_at, args}
    resp/{cmd_id}  device ->  QoS 1 (or the MQTT 5 ResponseTopic): {cmd_id, status, progress?, ...}
    events         device ->  QoS 1: install transitions, buffered on disk while offline
    health         device ->  QoS 1, retained: {status: ok|degraded|failing, checks}
    metrics        device ->  QoS 0, with a message expiry: periodic telemetry
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from edgeserve.config_allowlist import refused_keys
from edgeserve.fleet.jsonlimits import JsonRefused, loads
from edgeserve.ota.manifest import parse_rfc3339

PREFIX = "es/v1"
VERBS = ("deploy_bundle", "rollback", "activate_model", "deactivate_model", "set_config", "restart_runtime",
         "get_status", "cancel", "gc", "revoke_key")  # fmt: skip
LONG_VERBS = frozenset({"deploy_bundle", "rollback", "restart_runtime", "set_config", "activate_model",
                        "deactivate_model", "gc"})  # fmt: skip
ACCEPTED, IN_PROGRESS, SUCCEEDED, FAILED, REJECTED = (
    "ACCEPTED",
    "IN_PROGRESS",
    "SUCCEEDED",
    "FAILED",
    "REJECTED",
)
FINAL = frozenset({SUCCEEDED, FAILED, REJECTED})
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_PAYLOAD_BYTES = 256 * 1024
# A bundle URL: printable ASCII without spaces (it reaches logs, events and the downloader), bounded.
URL_RE = re.compile(r"^(https?|file)://[!-~]{1,2040}$")
KEY_ID_RE = re.compile(r"^[0-9a-f]{16}$")
REVOCABLE_ROLES = ("bundle", "command")  # the key files stay (read-only folder); the ids are refused


class CommandError(ValueError):
    """A command that is refused before it runs (REJECTED with this reason)."""


def check_segment(value: str, what: str) -> str:
    """A fleet or device id: one topic level, no wildcards or separators."""
    if not SEGMENT_RE.match(value):
        raise ValueError(f"{what} {value!r} must be letters, digits, '.', '_', '-' (no '/', '+', '#')")
    return value


@dataclass(frozen=True)
class Topics:
    fleet: str
    device: str

    @property
    def base(self) -> str:
        return f"{PREFIX}/{self.fleet}/{self.device}"

    def __getattr__(self, name: str) -> str:
        if name in ("state", "info", "desired", "reported", "events", "health", "metrics"):
            return f"{self.base}/{name}"
        raise AttributeError(name)

    def cmd(self, verb: str = "+") -> str:
        return f"{self.base}/cmd/{verb}"

    def resp(self, cmd_id: str) -> str:
        return f"{self.base}/resp/{cmd_id}"

    @staticmethod
    def fleet_wildcard(fleet: str, leaf: str) -> str:
        return f"{PREFIX}/{fleet}/+/{leaf}"

    @staticmethod
    def parse(topic: str) -> tuple[str, str, str]:
        """(fleet, device, rest) of a topic under the prefix."""
        parts = topic.split("/", 4)
        if len(parts) < 5 or f"{parts[0]}/{parts[1]}" != PREFIX:
            raise ValueError(f"{topic} is not an edgeserve fleet topic")
        return parts[2], parts[3], parts[4]


def utc(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any, field: str) -> datetime:
    if not isinstance(value, str):
        raise CommandError(f"'{field}' must be an RFC 3339 UTC time string")
    try:
        moment = parse_rfc3339(value)  # the same on 3.10 and 3.11+ (fromisoformat is not)
    except ValueError:
        raise CommandError(f"'{field}' {value!r} is not an RFC 3339 time") from None
    if moment.tzinfo is None:
        raise CommandError(f"'{field}' {value!r} has no time zone (use Z)")
    return moment


@dataclass(frozen=True)
class Command:
    cmd_id: str
    verb: str
    issued_at: datetime
    expires_at: datetime
    args: dict[str, Any]


def _require(args: dict[str, Any], key: str, kind: type, verb: str) -> Any:
    value = args.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CommandError(f"{verb} needs args.{key} ({kind.__name__})")
    return value


def check_args(verb: str, args: dict[str, Any]) -> None:
    if verb == "deploy_bundle":
        url = _require(args, "url", str, verb)
        if not URL_RE.match(url):
            raise CommandError(
                "deploy_bundle args.url must be an http(s):// or file:// URL of printable ASCII without "
                "spaces, at most 2048 characters"
            )
        sha = args.get("sha256")
        if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha)):
            raise CommandError("deploy_bundle args.sha256 must be 64 hex digits")
    elif verb == "rollback":
        if _require(args, "to_version", int, verb) < 1:
            raise CommandError("rollback args.to_version must be a positive version")
    elif verb in ("activate_model", "deactivate_model"):
        if not SEGMENT_RE.match(_require(args, "model", str, verb)):
            raise CommandError(f"{verb} args.model is not a model name")
    elif verb == "set_config":
        if not args or not all(isinstance(v, dict) and v for v in args.values()):
            raise CommandError("set_config args must be {section: {key: value}}")
        refused = refused_keys(args)
        if refused:  # all of them named, none applied
            raise CommandError(f"set_config may not change: {'; '.join(refused)}; nothing was applied")
    elif verb == "revoke_key":
        if not KEY_ID_RE.match(_require(args, "key_id", str, verb)):
            raise CommandError("revoke_key args.key_id must be 16 lowercase hex digits (the key id)")
        if args.get("role") not in REVOCABLE_ROLES:
            raise CommandError(f"revoke_key args.role must be one of: {', '.join(REVOCABLE_ROLES)}")
    elif verb == "cancel" and not ID_RE.match(_require(args, "cmd_id", str, verb)):
        raise CommandError("cancel args.cmd_id is not a command id")


def parse_command(verb: str, payload: bytes, now: datetime | None = None) -> Command:
    """Validate a command message; CommandError says why it is rejected."""
    if verb not in VERBS:
        raise CommandError(f"unknown verb {verb!r}; known: {', '.join(VERBS)}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise CommandError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    try:  # bounded: a payload nested thousands deep is refused, never a RecursionError
        body = loads(payload, max_bytes=MAX_PAYLOAD_BYTES)
    except JsonRefused as exc:
        raise CommandError(f"payload is not UTF-8 JSON within limits: {exc}") from None
    if not isinstance(body, dict):
        raise CommandError("payload must be a JSON object {cmd_id, issued_at, expires_at, args}")
    cmd_id = body.get("cmd_id")
    if not isinstance(cmd_id, str) or not ID_RE.match(cmd_id):
        raise CommandError("cmd_id must be 1-128 letters, digits, '.', '_', ':', '-'")
    issued, expires = (
        parse_time(body.get("issued_at"), "issued_at"),
        parse_time(body.get("expires_at"), "expires_at"),
    )
    args = body.get("args", {})
    if not isinstance(args, dict):
        raise CommandError("args must be a JSON object")
    moment = now or datetime.now(timezone.utc)
    if expires <= moment:
        raise CommandError(f"expired at {utc(expires)}")
    if expires <= issued:
        raise CommandError("expires_at is not after issued_at")
    check_args(verb, args)
    return Command(cmd_id, verb, issued, expires, args)
