"""A minimal fleet manager for the device-agent tests: publishes commands the way the fixed surface
says (QoS 1, never retained, signed for their topic with the test command key, MQTT 5 ResponseTopic +
CorrelationData, or resp/{cmd_id} on 3.1.1) and records every answer and every message on the device's
topics. `send` is the one place the tests publish commands; its options make the attacks (unsigned, a
wrong key, another topic, a tampered envelope, a foreign ResponseTopic)."""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fleet_keys import COMMAND_KEY

from edgeserve.fleet.signed import sign_command

Envelope = dict[str, Any]


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class Commander:
    def __init__(
        self,
        host: str,
        port: int,
        fleet: str,
        device: str,
        *,
        v5: bool = True,
        name: str | None = None,
        key: Ed25519PrivateKey = COMMAND_KEY,
        **tls: Any,
    ) -> None:
        self.base = f"es/v1/{fleet}/{device}"
        self.key = key
        self.v5 = v5
        self.name = name or f"manager-{uuid.uuid4().hex[:6]}"
        self.reply_topic = f"es/v1/{fleet}/manager/{self.name}/resp"
        self.answers: dict[str, list[dict[str, Any]]] = {}
        self.messages: list[tuple[str, dict[str, Any], bool]] = []  # (topic, body, retained)
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.name,
                                  protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311)  # fmt: skip
        if "username" in tls:
            self.client.username_pw_set(tls.pop("username"), tls.pop("password"))
        if tls:
            self.client.tls_set(ca_certs=tls["ca_file"], certfile=tls["cert_file"], keyfile=tls["key_file"])
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.connect(host, port, 30)
        self.client.loop_start()
        if not self._connected.wait(10):
            raise AssertionError("the manager could not connect to the broker")

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        client.subscribe(self.reply_topic, qos=1)
        client.subscribe(f"{self.base}/#", qos=1)
        self._connected.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            body = json.loads(message.payload) if message.payload else {}
        except (ValueError, RecursionError):  # the attack tests publish garbage on the device's topics
            body = {"raw": message.payload.decode(errors="replace")}
        with self._lock:
            self.messages.append((message.topic, body, bool(message.retain)))
            if message.topic == self.reply_topic or "/resp/" in message.topic:
                correlation = getattr(getattr(message, "properties", None), "CorrelationData", None)
                key = correlation.decode() if correlation else body.get("cmd_id")
                self.answers.setdefault(str(key), []).append(body)

    def send(
        self,
        verb: str,
        args: dict[str, Any] | None = None,
        *,
        cmd_id: str | None = None,
        expires_in_s: float = 120,
        issued_in_s: float = 0,
        retain: bool = False,
        raw: bytes | None = None,
        extra: dict[str, Any] | None = None,
        unsigned: bool = False,
        key: Ed25519PrivateKey | None = None,
        to: str | None = None,
        signed_for: str | None = None,
        response_topic: str | None = None,
        tamper: Callable[[Envelope], Envelope] | None = None,
    ) -> str:
        """Publish one command on this device's `cmd/{verb}` (or on `to`), signed with this commander's key
        (or `key`) for that topic (or for `signed_for`); `unsigned` sends the bare command, `raw` exactly
        these bytes, `tamper` rewrites the envelope after signing. Returns the cmd_id."""
        cmd_id = cmd_id or uuid.uuid4().hex[:12]
        now = datetime.now(timezone.utc) + timedelta(seconds=issued_in_s)
        expires = now + timedelta(seconds=expires_in_s)
        body = {"cmd_id": cmd_id, "issued_at": stamp(now), "expires_at": stamp(expires), "args": args or {}}
        text = json.dumps({**body, **(extra or {})})
        topic = to or f"{self.base}/cmd/{verb}"
        payload = raw if raw is not None else self.wrap(signed_for or topic, text, unsigned, key, tamper)
        properties = None
        if self.v5:
            properties = Properties(PacketTypes.PUBLISH)
            properties.ResponseTopic = response_topic or self.reply_topic
            properties.CorrelationData = cmd_id.encode()
        else:
            self.client.subscribe(f"{self.base}/resp/{cmd_id}", qos=1)
            time.sleep(0.2)
        self.client.publish(topic, payload, qos=1, retain=retain, properties=properties).wait_for_publish(5)
        return cmd_id

    def wrap(
        self,
        topic: str,
        text: str,
        unsigned: bool = False,
        key: Ed25519PrivateKey | None = None,
        tamper: Callable[[Envelope], Envelope] | None = None,
    ) -> bytes:
        """`text` as it goes on the wire to `topic`: the signed envelope (or the bare text when unsigned)."""
        if unsigned:
            return text.encode()
        envelope = sign_command(key or self.key, topic, text)
        return json.dumps(tamper(json.loads(envelope))).encode() if tamper else envelope

    def set_desired(self, state: dict[str, Any] | None, **sign: Any) -> None:
        """Publish the device's desired state, retained and signed as `wrap` says (None clears it)."""
        topic = f"{self.base}/desired"
        payload = b"" if state is None else self.wrap(topic, json.dumps(state), **sign)
        self.client.publish(topic, payload, qos=1, retain=True).wait_for_publish(5)

    def wait(self, cmd_id: str, timeout_s: float = 120) -> dict[str, Any]:
        """The final answer (SUCCEEDED / FAILED / REJECTED) to `cmd_id`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                for answer in self.answers.get(cmd_id, []):
                    if answer.get("status") in ("SUCCEEDED", "FAILED", "REJECTED"):
                        return answer
            time.sleep(0.05)
        raise AssertionError(f"no final answer to {cmd_id} in {timeout_s}s; got {self.answers.get(cmd_id)}")

    def all_answers(self, cmd_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.answers.get(cmd_id, []))

    def on(self, leaf: str) -> list[dict[str, Any]]:
        with self._lock:
            return [body for topic, body, _ in self.messages if topic == f"{self.base}/{leaf}"]

    def wait_on(self, leaf: str, check: Any, timeout_s: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for body in reversed(self.on(leaf)):
                if check(body):
                    return body
            time.sleep(0.05)
        raise AssertionError(f"nothing on {leaf} matched within {timeout_s}s; last: {self.on(leaf)[-3:]}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
