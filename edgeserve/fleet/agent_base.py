"""What the two device agents share (MQTT commands: agent.py; AWS IoT Jobs: aws_jobs_agent.py): who the
device is, its `fleet/` state folder and command ledger, and the broker connection's life (the retained
presence message, the last will that marks the device offline, the reconnect on a lost connection)."""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from edgeserve.config import FleetSection
from edgeserve.fleet.connection import device_id, make_client, payload
from edgeserve.fleet.ledger import CommandLedger
from edgeserve.fleet.protocol import utc
from edgeserve.fleet.services import DeviceServices
from edgeserve.ota.trust import TrustStore, default_trust_dir

log = logging.getLogger("edgeserve.fleet")


def utc_now() -> str:
    return utc(datetime.now(timezone.utc))


class AgentBase:
    def __init__(
        self,
        settings: FleetSection,
        state_dir: Path,
        services: DeviceServices,
        version: str,
        trust: TrustStore | None = None,
    ) -> None:
        self.settings = settings
        self.services = services
        self.version = version
        self.device = device_id(settings)
        self.trust = trust or TrustStore(default_trust_dir(state_dir), state_dir)
        self.folder = state_dir / "fleet"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ledger = CommandLedger(self.folder / "commands.json", settings.max_command_lifetime_s)
        self.boot_id = uuid.uuid4().hex[:12]
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._init_agent()

    def _init_agent(self) -> None:
        """The agent's own state, its client (`_make_client`), and what an interrupted command left."""
        raise NotImplementedError

    def _make_client(self, client_id: str, presence: str) -> None:
        """The MQTT client; should the device vanish, the broker publishes it offline on `presence`."""
        self.client = make_client(
            self.settings, client_id, presence, {"online": False, "device": self.device}
        )
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message

    def _online(self) -> dict[str, Any]:
        """The retained presence message published at every connect."""
        return {
            "online": True,
            "device": self.device,
            "boot_id": self.boot_id,
            "version": self.version,
            "at": utc_now(),
        }

    def _goodbye(self, presence: str) -> None:
        """Publish the retained offline state (a clean stop, not the last will), then disconnect."""
        if self.connected.is_set():
            offline = {"online": False, "device": self.device, "at": utc_now()}
            info = self.client.publish(presence, payload(offline), qos=1, retain=True)
            with contextlib.suppress(RuntimeError, ValueError):
                info.wait_for_publish(2)
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        if reason.is_failure:
            log.warning("fleet broker refused the connection: %s", reason)
            return
        self._on_accepted(client, flags)

    def _on_accepted(self, client: mqtt.Client, flags: Any) -> None:
        """Connected: subscribe, say online, send what waited for the connection."""
        raise NotImplementedError

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        raise NotImplementedError

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        self.connected.clear()
        if not self._stop.is_set():
            log.warning("fleet broker connection lost (%s); reconnecting with backoff", reason)
