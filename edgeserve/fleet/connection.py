"""paho-mqtt 2.x set up the way a device needs it: TLS with client certificates, a persistent session
(commands sent while the device was away are delivered when it is back), the `online: false` will,
reconnects with backoff and jitter, MQTT 5 with a 3.1.1 fallback."""

from __future__ import annotations

import json
import random
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgeserve.config import FleetSection

SESSION_EXPIRY_S = 7 * 24 * 3600  # the broker keeps our subscriptions and queued commands a week


@dataclass(frozen=True)
class Broker:
    host: str
    port: int
    tls: bool


def parse_broker(url: str) -> Broker:
    parsed = urlparse(url)
    tls = parsed.scheme == "mqtts"
    if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
        raise ValueError(f"broker {url!r} is not mqtt://host[:port] or mqtts://host[:port]")
    return Broker(parsed.hostname, parsed.port or (8883 if tls else 1883), tls)


def payload(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), default=str).encode()


def publish_properties(expiry_s: int | None = None, correlation: bytes | None = None) -> Properties:
    properties = Properties(PacketTypes.PUBLISH)
    properties.ContentType = "application/json"
    if expiry_s is not None:
        properties.MessageExpiryInterval = int(expiry_s)
    if correlation is not None:
        properties.CorrelationData = correlation
    return properties


def make_client(settings: FleetSection, client_id: str, will_topic: str, will: dict[str, Any]) -> mqtt.Client:
    v5 = settings.protocol == "5"
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
        clean_session=None if v5 else False,
    )
    if settings.username:
        client.username_pw_set(settings.username, settings.password or None)
    broker = parse_broker(settings.broker)
    if broker.tls or settings.ca_file or settings.cert_file:
        client.tls_set(
            ca_certs=str(settings.ca_file) if settings.ca_file else None,
            certfile=str(settings.cert_file) if settings.cert_file else None,
            keyfile=str(settings.key_file) if settings.key_file else None,
            cert_reqs=ssl.CERT_REQUIRED,
        )
    will_props = publish_properties() if v5 else None
    client.will_set(will_topic, payload(will), qos=1, retain=True, properties=will_props)
    # Jitter: a thousand devices that lost the same broker must not come back in the same second.
    client.reconnect_delay_set(min_delay=1 + random.randint(0, 2), max_delay=60 + random.randint(0, 30))
    client.max_queued_messages_set(1000)  # bounded: QoS 1 answers waiting for a connection
    return client


def connect(client: mqtt.Client, settings: FleetSection) -> None:
    """Start connecting in the background; paho's loop thread reconnects for as long as it runs."""
    broker = parse_broker(settings.broker)
    if settings.protocol == "5":
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = SESSION_EXPIRY_S
        client.connect_async(
            broker.host, broker.port, settings.keepalive_s, clean_start=False, properties=properties
        )
    else:
        client.connect_async(broker.host, broker.port, settings.keepalive_s)
    client.loop_start()


def device_id(settings: FleetSection) -> str:
    """`[fleet] device_id`, else the host name ("manager" is the fleet tools' namespace: never a device)."""
    name = settings.device_id or socket.gethostname().split(".")[0]
    if name == "manager":
        raise ValueError(
            "a device may not be named 'manager' (the fleet tools' inbox namespace): set [fleet] device_id"
        )
    return name


Handler = Callable[[mqtt.MQTTMessage], None]
