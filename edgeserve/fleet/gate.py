"""What the device agent lets in from the broker, and where its answers may go (OTA.md "Signed commands").

A command or desired state is trusted for what it says, not for where it came from: it must be signed
by a trusted command key for the very topic it arrived on (unless `[fleet] require_signed_commands =
false`, a lab opt-out that still verifies whatever is signed), and a command must live no longer than
`[fleet] max_command_lifetime_s`. Answers go to an MQTT 5 ResponseTopic only in the fleet tool's inbox
form `es/v1/{fleet}/manager/{name}/resp`; otherwise to the device's own `resp/{cmd_id}`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import paho.mqtt.client as mqtt

from edgeserve.config import FleetSection
from edgeserve.fleet.jsonlimits import JsonRefused, loads
from edgeserve.fleet.protocol import (
    ID_RE,
    MAX_PAYLOAD_BYTES,
    PREFIX,
    REJECTED,
    SEGMENT_RE,
    Command,
    CommandError,
    Topics,
    parse_command,
    utc,
)
from edgeserve.fleet.signed import CommandKeys, check_lifetime, is_envelope, open_envelope, peek_cmd_id
from edgeserve.logs import safe
from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.trust import TrustStore

log = logging.getLogger("edgeserve.fleet")

UNSIGNED = (
    "unsigned {what} refused: this device runs only commands and desired states signed by a trusted "
    "command key ([fleet] require_signed_commands = true; fleet tools sign with --key)"
)


def default_command_keys(trust_dir: Path) -> Path:
    """Where the trusted command keys are when `[fleet] command_keys` is not set: `<trust_dir>/commands`."""
    return trust_dir / "commands"


@dataclass
class Reply:
    topic: str
    correlation: bytes | None = None


@dataclass(frozen=True)
class Admission:
    message: mqtt.MQTTMessage | None = None  # let in: its payload is the verified command text
    error: str | None = None  # refused: answered REJECTED with this, never run
    cmd_id: str | None = None  # a well-formed cmd_id to address the answer to


def _revoked_commands(trust: TrustStore) -> frozenset[str] | None:
    """The command key ids the fleet revoked; None (trust no command key) when the list is unreadable."""
    try:
        return frozenset(trust.revoked("command"))
    except BundleRefused as exc:
        log.warning("fleet: %s; no command key is trusted until it is repaired", safe(exc, 300))
        return None


def command_keys(settings: FleetSection, trust: TrustStore) -> CommandKeys:
    """The keys that may sign commands: `[fleet] command_keys` (else `<trust_dir>/commands`) less the
    key ids the fleet revoked."""
    folder = settings.command_keys or default_command_keys(trust.trust_dir)
    return CommandKeys(folder, lambda: _revoked_commands(trust))


def check_self_revocation(command: Command, signer: str | None) -> None:
    """A command key is revoked by a command only with itself: the fleet still holds a leaked key and
    revokes it with it, while the thief cannot revoke the fleet's other command keys to lock it out."""
    args = command.args
    if command.verb == "revoke_key" and args.get("role") == "command" and args.get("key_id") != signer:
        raise CommandError(
            "revoke_key of a command key must be signed by that key itself (a key cannot revoke "
            "another command key; replace keys in the command_keys folder)"
        )


class CommandGate:
    def __init__(self, settings: FleetSection, topics: Topics, trust: TrustStore) -> None:
        self.topics = topics
        self.require = settings.require_signed_commands
        self.max_lifetime_s = settings.max_command_lifetime_s
        self.keys = command_keys(settings, trust)
        self.desired_rejected: dict[str, str] | None = None  # the last desired state, when it was refused
        name = SEGMENT_RE.pattern.strip("^$")  # one topic level, as the fleet tool's client id is
        self._inbox = re.compile(rf"^{re.escape(PREFIX)}/{re.escape(topics.fleet)}/manager/{name}/resp$")

    def describe(self) -> None:
        """Say at start what will be let in, loudly when nothing will."""
        keys, folder = self.keys.current(), self.keys.folder
        if keys:
            log.info("fleet: %d trusted command key(s) in %s: %s", len(keys), folder, ", ".join(sorted(keys)))
        elif self.require:
            log.error("fleet: no trusted command key (*.pub) in %s: every command and desired state is "
                      "refused until one is put there (see ota/keys-policy.md)", folder)  # fmt: skip
        if not self.require:
            log.warning("fleet: [fleet] require_signed_commands = false: UNSIGNED commands are run; anyone "
                        "who can publish on this device's topics commands it (a lab setting)")  # fmt: skip

    def admit(self, message: mqtt.MQTTMessage, now: datetime) -> Admission:
        topic = message.topic
        desired = topic == self.topics.desired
        if not desired and not topic.startswith(self.topics.cmd("")):
            return Admission()
        payload = bytes(message.payload or b"")
        if not payload:
            return Admission()  # a retained message being cleared: nothing was said
        raw_id = None if desired else peek_cmd_id(payload)
        cmd_id = raw_id if isinstance(raw_id, str) and ID_RE.match(raw_id) else None
        try:
            text, signer = self._verified(topic, payload, "desired state" if desired else "command")
            if not desired:
                command = parse_command(topic[len(self.topics.cmd("")) :], text, now)
                check_lifetime(command, now, self.max_lifetime_s)
                check_self_revocation(command, signer)
        except CommandError as exc:
            what = "desired state" if desired else f"command {safe(raw_id)}"
            log.warning("fleet: %s on %s REJECTED: %s", what, safe(topic), safe(exc, 300))
            if desired:
                self.refuse_desired(str(exc), now)
            return Admission(error=str(exc), cmd_id=cmd_id)
        if desired:
            self.desired_rejected = None
        inner = mqtt.MQTTMessage(message.mid, topic.encode("utf-8"))
        inner.payload, inner.qos, inner.retain = text, message.qos, message.retain
        inner.properties = getattr(message, "properties", None)
        return Admission(inner, cmd_id=cmd_id)

    def refuse_desired(self, reason: str, now: datetime | None = None) -> None:
        """The last desired state was not acted on (shown in `reported`, so it cannot pin the device)."""
        self.desired_rejected = {
            "status": REJECTED,
            "error": reason,
            "at": utc(now or datetime.now(timezone.utc)),
        }

    def _verified(self, topic: str, payload: bytes, what: str) -> tuple[bytes, str | None]:
        """The command text and the key id that signed it (None: unsigned, allowed in a lab)."""
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise CommandError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
        try:  # not JSON, or over a limit (nested too deep...): not an envelope, so unsigned
            body = loads(payload, max_bytes=MAX_PAYLOAD_BYTES)
        except JsonRefused:
            body = None
        if is_envelope(body):
            opened = open_envelope(topic, payload, self.keys.current())
            log.info("fleet: %s on %s signed by command key %s", what, safe(topic), opened.key_id)
            return opened.text.encode("utf-8"), opened.key_id
        if self.require:
            raise CommandError(UNSIGNED.format(what=what))
        return payload, None

    # -- answers ----------------------------------------------------------------------------------------
    def is_inbox(self, topic: str) -> bool:
        return bool(self._inbox.match(topic))

    def may_publish(self, topic: str) -> bool:
        """The device publishes under its own prefix and to the fleet tools' inboxes, nowhere else."""
        return topic.startswith(self.topics.base + "/") or self.is_inbox(topic)

    def reply_to(self, message: mqtt.MQTTMessage, cmd_id: str | None) -> Reply | None:
        props = getattr(message, "properties", None)
        topic = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation = getattr(props, "CorrelationData", None) if props is not None else None
        if topic and self.is_inbox(str(topic)):
            return Reply(str(topic), bytes(correlation) if correlation is not None else None)
        if topic:
            log.warning("fleet: ResponseTopic '%s' ignored (not %s/%s/manager/<name>/resp); answering on "
                        "resp/<cmd_id>", safe(topic), PREFIX, self.topics.fleet)  # fmt: skip
        return Reply(self.topics.resp(cmd_id)) if cmd_id and ID_RE.match(cmd_id) else None
