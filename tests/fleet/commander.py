"""A minimal fleet manager for the device-agent tests: publishes commands the way the fixed surface
says (QoS 1, never retained, MQTT 5 ResponseTopic + CorrelationData, or resp/{cmd_id} on 3.1.1) and
records every answer and every message on the device's topics."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class Commander:
    def __init__(self, host: str, port: int, fleet: str, device: str, *, v5: bool = True,
                 name: str | None = None, **tls: Any) -> None:  # fmt: skip
        self.base = f"es/v1/{fleet}/{device}"
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
        except ValueError:
            body = {"raw": message.payload.decode(errors="replace")}
        with self._lock:
            self.messages.append((message.topic, body, bool(message.retain)))
            if message.topic == self.reply_topic or "/resp/" in message.topic:
                correlation = getattr(getattr(message, "properties", None), "CorrelationData", None)
                key = correlation.decode() if correlation else body.get("cmd_id")
                self.answers.setdefault(str(key), []).append(body)

    def send(self, verb: str, args: dict[str, Any] | None = None, *, cmd_id: str | None = None,
             expires_in_s: float = 120, retain: bool = False, raw: bytes | None = None,
             extra: dict[str, Any] | None = None) -> str:  # fmt: skip
        cmd_id = cmd_id or uuid.uuid4().hex[:12]
        now = datetime.now(timezone.utc)
        body = {"cmd_id": cmd_id, "issued_at": stamp(now),
                "expires_at": stamp(now + timedelta(seconds=expires_in_s)), "args": args or {}, **(extra or {})}  # fmt: skip
        properties = None
        if self.v5:
            properties = Properties(PacketTypes.PUBLISH)
            properties.ResponseTopic = self.reply_topic
            properties.CorrelationData = cmd_id.encode()
        else:
            self.client.subscribe(f"{self.base}/resp/{cmd_id}", qos=1)
            time.sleep(0.2)
        self.client.publish(f"{self.base}/cmd/{verb}", raw if raw is not None else json.dumps(body), qos=1,
                            retain=retain, properties=properties).wait_for_publish(5)  # fmt: skip
        return cmd_id

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
