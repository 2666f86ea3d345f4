"""Where results go: a Python callback, ZeroMQ PUB, MQTT (one topic per stream).

    --publish mqtt://[user:password@]host[:port][/prefix]   topic <prefix>/<stream>, QoS 0
    --publish mqtts://...                                   the same over TLS (system CAs)
    --publish zmq://host:port                               PUB bound on tcp://host:port
    --publish zmq:///path/to/socket                         PUB bound on ipc:///path/to/socket

ZeroMQ messages have two parts: the stream id (subscribers filter on it) and the JSON result.
MQTT's default prefix is `edgeserve/video`; the password may also come from
$EDGESERVE_WATCH_MQTT_PASSWORD (kept out of the process list). Publishing never waits: a result a
sink cannot take now (no broker connection, a full ZeroMQ queue) is dropped and counted.
"""

from __future__ import annotations

import logging
import os
import ssl
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from edgeserve.video.results import Result
from edgeserve.video.sources import SourceError

log = logging.getLogger("edgeserve.video")

DEFAULT_MQTT_PREFIX = "edgeserve/video"


class Sink:
    """Takes results on the dispatcher's thread; `publish` must not block."""

    name = "sink"
    sent = 0
    dropped = 0

    def publish(self, result: Result, payload: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CallbackSink(Sink):
    """Calls `callback(result)` for each result (on the dispatcher's thread: hand heavy work off)."""

    name = "callback"

    def __init__(self, callback: Callable[[Result], Any]) -> None:
        self.callback = callback

    def publish(self, result: Result, payload: bytes) -> None:
        try:
            self.callback(result)
            self.sent += 1
        except Exception:
            self.dropped += 1
            log.exception("result callback failed")


class ZmqPubSink(Sink):
    def __init__(self, endpoint: str) -> None:
        import zmq

        self.name = endpoint
        self._zmq = zmq
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 1000)
        self._sock.setsockopt(zmq.LINGER, 500)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise SourceError(f"--publish {endpoint}: cannot bind: {exc}") from None

    def publish(self, result: Result, payload: bytes) -> None:
        try:
            self._sock.send_multipart([result.stream.encode(), payload], flags=self._zmq.DONTWAIT)
            self.sent += 1
        except self._zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._sock.close()


class MqttSink(Sink):
    def __init__(
        self, host: str, port: int, prefix: str, *, tls: bool, username: str | None, password: str | None
    ) -> None:
        import paho.mqtt.client as mqtt

        self.name = f"mqtt{'s' if tls else ''}://{host}:{port}/{prefix}"
        self.prefix = prefix
        self._client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgeserve-watch-{uuid.uuid4().hex[:12]}"
        )
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls:
            self._client.tls_set_context(ssl.create_default_context())
        self._client.reconnect_delay_set(0.5, 10)
        self._client.connect_async(host, port, keepalive=30)
        self._client.loop_start()

    def publish(self, result: Result, payload: bytes) -> None:
        info = self._client.publish(f"{self.prefix}/{result.stream}", payload, qos=0)
        if info.rc == 0:
            self.sent += 1
        else:
            self.dropped += 1

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


def open_sink(url: str) -> Sink:
    """A sink for a --publish URL; SourceError (exit 2) when the URL is not one of the forms above."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("mqtt", "mqtts"):
        if not parts.hostname:
            raise SourceError(f"--publish {url}: no broker host (mqtt://host[:port][/prefix])")
        try:
            port = parts.port or (8883 if scheme == "mqtts" else 1883)
        except ValueError:
            raise SourceError(f"--publish {url}: bad port") from None
        prefix = parts.path.strip("/") or DEFAULT_MQTT_PREFIX
        if any(c in prefix for c in "+#\0") or parts.fragment or url.endswith("#"):
            raise SourceError(f"--publish {url}: the topic prefix may not contain +, # or NUL")
        password = (
            unquote(parts.password) if parts.password else os.environ.get("EDGESERVE_WATCH_MQTT_PASSWORD")
        )
        username = unquote(parts.username) if parts.username else None
        return MqttSink(
            parts.hostname, port, prefix, tls=scheme == "mqtts", username=username, password=password
        )
    if scheme == "zmq":
        if parts.hostname:
            try:
                zport = parts.port
            except ValueError:
                zport = None
            if not zport:
                raise SourceError(f"--publish {url}: needs a port (zmq://host:port)")
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            return ZmqPubSink(f"tcp://{host}:{zport}")
        if parts.path:
            return ZmqPubSink(f"ipc://{parts.path}")
        raise SourceError(f"--publish {url}: needs zmq://host:port or zmq:///socket/path")
    raise SourceError(f"--publish {url}: unsupported (mqtt://, mqtts://, zmq://host:port, zmq:///path)")
