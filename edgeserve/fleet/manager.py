"""The fleet side of the MQTT surface in `edgeserve.fleet.protocol`: list the devices from their retained
topics, send one command and follow its answers, roll a bundle out in staged waves, watch the fleet.

    with FleetManager("mqtt://broker:1883", "plant-7") as fleet:
        for record in fleet.devices():
            print(record["device"], record["online"], record["active_version"])
        answer = fleet.send("cam-01", "get_status", {})
        report = fleet.deploy("https://repo/bundle-v8.tar", selector="cam-*", canary_percent=10, wave_size=20)

One paho-mqtt 2.x client, its network loop in a background thread (paho reconnects by itself and the
subscriptions are made again at every connect). The manager keeps a live cache of every device's retained
`state`, `info`, `health` and `reported`; `devices()` waits for the broker to have delivered the retained
picture (a round trip on the manager's own topic after the subscriptions were acknowledged) and returns it.

Commands are QoS 1 and never retained, with a fresh `cmd_id`, `issued_at` now and `expires_at` now + the
timeout. With MQTT 5 they carry ResponseTopic `es/v1/{fleet}/manager/{client_id}/resp` (subscribed at
connect) and CorrelationData = the cmd_id's bytes; with MQTT 3.1.1 the manager subscribes to the device's
`resp/{cmd_id}` before it publishes. The answer stream is ACCEPTED, IN_PROGRESS..., then one of SUCCEEDED,
FAILED, REJECTED; no final answer before the timeout gives a synthetic {"status": "TIMEOUT"}.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeserve.fleet.protocol import FINAL, PREFIX, VERBS, CommandError, Topics, check_args, utc
from edgeserve.fleet.records import BrokerAddress, Json, Pending, device_record, segment, timed_out
from edgeserve.fleet.records import FleetError as FleetError  # re-exported: library users import it here
from edgeserve.fleet.records import plan_waves as plan_waves  # re-exported: library users import it here
from edgeserve.fleet.records import select_devices as select_devices
from edgeserve.fleet.rollout import Rollout, send_many
from edgeserve.fleet.signed import load_signing_key, sign_command

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

RETAINED_LEAVES = ("state", "info", "health", "reported")
WATCH_LEAVES = ("state", "health", "events", "reported")

UpdateCallback = Callable[[Json], None]
WatchCallback = Callable[[str, str, Json, bool], None]


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _json(payload: bytes) -> Json | None:
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return body if isinstance(body, dict) else None


class FleetManager:
    """A connection to the fleet's broker (see the module text). Use as a context manager, or call
    `connect()` and `close()`."""

    def __init__(
        self,
        broker_url: str,
        fleet: str,
        *,
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        protocol: str = "5",
        connect_timeout_s: float = 10.0,
        keepalive_s: int = 30,
        command_key: Ed25519PrivateKey | str | Path | None = None,
    ) -> None:
        self.address = BrokerAddress.parse(broker_url)
        try:  # every command and desired state is signed with it; None: unsigned (lab devices only)
            self.command_key = load_signing_key(command_key)
        except ValueError as exc:
            raise FleetError(str(exc)) from None
        self.fleet = segment(fleet, "fleet")
        self.client_id = segment(client_id or f"mgr-{uuid.uuid4().hex[:12]}", "client id")
        if protocol not in ("5", "3.1.1", "311"):
            raise FleetError(f"protocol {protocol!r}: use 5 or 3.1.1")
        self.mqtt5 = protocol == "5"
        self.username, self.password = username, password
        self.ca_file, self.cert_file, self.key_file = ca_file, cert_file, key_file
        self.connect_timeout_s, self.keepalive_s = connect_timeout_s, keepalive_s
        self.response_topic = f"{PREFIX}/{self.fleet}/manager/{self.client_id}/resp"
        self._sync_topic = f"{PREFIX}/{self.fleet}/manager/{self.client_id}/sync"
        self._lock = threading.Lock()
        self._cache: dict[str, dict[str, Json]] = {}
        self._pending: dict[str, Pending] = {}
        self._watchers: list[WatchCallback] = []
        self._suback: dict[int, threading.Event] = {}
        self._early_acks: set[int] = set()
        self._syncs: dict[str, threading.Event] = {}
        self._connected = threading.Event()
        self._ready = threading.Event()  # connected and the base subscriptions acknowledged
        self._connect_error: str | None = None
        self._client: Any = None

    # -- connection ---------------------------------------------------------------------------------

    def __enter__(self) -> FleetManager:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> FleetManager:
        import paho.mqtt.client as mqtt

        kwargs: dict[str, Any] = {"client_id": self.client_id}
        if self.mqtt5:
            kwargs["protocol"] = mqtt.MQTTv5
        else:
            kwargs.update(protocol=mqtt.MQTTv311, clean_session=True)
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, **kwargs)
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        if self.address.tls or self.ca_file or self.cert_file:
            try:
                client.tls_set(
                    ca_certs=self.ca_file,
                    certfile=self.cert_file,
                    keyfile=self.key_file,
                    cert_reqs=ssl.CERT_REQUIRED,
                    tls_version=ssl.PROTOCOL_TLS_CLIENT,
                )
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise FleetError(f"TLS files: {exc}") from None
        client.reconnect_delay_set(min_delay=1, max_delay=10)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        self._client = client
        where = f"{'mqtts' if self.address.tls else 'mqtt'}://{self.address.host}:{self.address.port}"
        try:
            if self.mqtt5:
                client.connect(
                    self.address.host, self.address.port, keepalive=self.keepalive_s, clean_start=True
                )
            else:
                client.connect(self.address.host, self.address.port, keepalive=self.keepalive_s)
        except (OSError, ssl.SSLError) as exc:
            self._client = None
            raise FleetError(f"cannot connect to the broker at {where}: {exc}") from None
        client.loop_start()
        deadline = time.monotonic() + self.connect_timeout_s
        while not self._ready.wait(0.05):
            if self._connect_error or time.monotonic() > deadline:
                break
        if not self._ready.is_set():
            reason = self._connect_error or f"no CONNACK/SUBACK within {self.connect_timeout_s:g} s"
            self.close()
            raise FleetError(f"broker at {where} refused or did not answer: {reason}")
        return self

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            client.disconnect()
        finally:
            client.loop_stop()
        self._ready.clear()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if getattr(reason_code, "is_failure", False):
            self._connect_error = str(reason_code)
            client.disconnect()  # do not let paho retry bad credentials forever
            return
        self._connected.set()
        topics = [(Topics.fleet_wildcard(self.fleet, leaf), 1) for leaf in RETAINED_LEAVES]
        topics += [(self.response_topic, 1), (self._sync_topic, 1)]
        if self._watchers:
            topics.append((Topics.fleet_wildcard(self.fleet, "events"), 1))
        done = threading.Event()
        _result, mid = client.subscribe(topics)
        with self._lock:
            self._suback[mid] = done
        threading.Thread(target=self._mark_ready, args=(done,), daemon=True).start()

    def _mark_ready(self, done: threading.Event) -> None:
        if done.wait(self.connect_timeout_s):
            self._ready.set()

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        self._ready.clear()
        if not self._connected.is_set() and self._connect_error is None:
            self._connect_error = f"the broker closed the connection before CONNACK ({reason_code})"

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        with self._lock:
            done = self._suback.pop(mid, None)
            if done is None:
                self._early_acks.add(mid)  # acknowledged before the caller registered the mid
        if done is not None:
            done.set()

    def _require_client(self) -> Any:
        if self._client is None:
            raise FleetError("the manager is not connected (use `with FleetManager(...)` or connect())")
        return self._client

    def _subscribe(self, topics: list[tuple[str, int]], timeout_s: float) -> None:
        client = self._require_client()
        done = threading.Event()
        result, mid = client.subscribe(topics)
        with self._lock:
            if mid in self._early_acks:
                self._early_acks.discard(mid)
                done.set()
            else:
                self._suback[mid] = done
        if result != 0 or not done.wait(timeout_s):
            raise FleetError(f"the broker did not acknowledge the subscription to {topics[0][0]}")

    def sync(self, timeout_s: float) -> bool:
        """Wait until every message the broker queued for us before now has arrived (a round trip through
        our own topic: the broker delivers to one session in order)."""
        if not self._ready.wait(timeout_s):
            return False
        token = uuid.uuid4().hex
        done = threading.Event()
        with self._lock:
            self._syncs[token] = done
        self._require_client().publish(self._sync_topic, token.encode(), qos=1)
        try:
            return done.wait(timeout_s)
        finally:
            with self._lock:
                self._syncs.pop(token, None)

    # -- incoming -----------------------------------------------------------------------------------

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        topic: str = msg.topic
        if topic == self._sync_topic:
            with self._lock:
                done = self._syncs.get(msg.payload.decode("ascii", "replace"))
            if done is not None:
                done.set()
            return
        body = _json(msg.payload)
        if topic == self.response_topic:
            correlation = getattr(msg.properties, "CorrelationData", None) if msg.properties else None
            cmd_id = correlation.decode("utf-8", "replace") if correlation else None
            self._answer(cmd_id or (body or {}).get("cmd_id"), body)
            return
        try:
            _fleet, device, rest = Topics.parse(topic)
        except ValueError:
            return
        if rest.startswith("resp/"):
            self._answer(rest[5:], body)
            return
        if rest in RETAINED_LEAVES:
            with self._lock:
                topics = self._cache.setdefault(device, {})
                if body is None and not msg.payload:
                    topics.pop(rest, None)  # a retained message cleared with an empty payload
                    if not topics:
                        self._cache.pop(device, None)
                elif body is not None:
                    topics[rest] = body
        if rest in WATCH_LEAVES and body is not None:
            with self._lock:
                watchers = list(self._watchers)
            for watcher in watchers:
                with contextlib.suppress(Exception):  # a watcher must not kill the network loop
                    watcher(device, rest, body, bool(msg.retain))

    def _answer(self, cmd_id: str | None, body: Json | None) -> None:
        if not cmd_id or body is None:
            return
        with self._lock:
            pending = self._pending.get(cmd_id)
        if pending is not None:
            pending.sink.put((cmd_id, body))

    # -- devices ------------------------------------------------------------------------------------

    def devices(self, timeout_s: float = 5.0) -> list[Json]:
        """Every device with a retained topic in the fleet, merged (see `device_record`), sorted by id."""
        if not self.sync(timeout_s):
            raise FleetError(f"the broker did not deliver the fleet's retained topics within {timeout_s:g} s")
        return self.cached_devices()

    def cached_devices(self) -> list[Json]:
        with self._lock:
            snapshot = {device: dict(topics) for device, topics in self._cache.items()}
        return [device_record(device, topics) for device, topics in sorted(snapshot.items())]

    def device(self, device: str) -> Json | None:
        with self._lock:
            topics = dict(self._cache.get(device, {}))
        return device_record(device, topics) if topics else None

    # -- commands -----------------------------------------------------------------------------------

    def issue(
        self,
        device: str,
        verb: str,
        args: Json | None = None,
        timeout_s: float = 60.0,
        *,
        sink: queue.Queue[tuple[str, Json]] | None = None,
        cmd_id: str | None = None,
    ) -> Pending:
        """Publish one command and return its pending record (answers go to `sink`); see `send`."""
        segment(device, "device")
        if verb not in VERBS:
            raise FleetError(f"unknown verb {verb!r}; known: {', '.join(VERBS)}")
        args = dict(args or {})
        try:
            check_args(verb, args)
        except CommandError as exc:
            raise FleetError(str(exc)) from None
        client = self._require_client()
        cmd_id = cmd_id or f"{self.client_id}-{uuid.uuid4().hex[:16]}"
        topics = Topics(self.fleet, device)
        pending = Pending(cmd_id, device, verb, sink or queue.Queue())
        with self._lock:
            self._pending[cmd_id] = pending
        properties = None
        if self.mqtt5:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            properties = Properties(PacketTypes.PUBLISH)
            properties.ResponseTopic = self.response_topic
            properties.CorrelationData = cmd_id.encode()
        else:
            pending.unsubscribe = topics.resp(cmd_id)
            try:
                self._subscribe([(pending.unsubscribe, 1)], min(timeout_s, 10.0))
            except FleetError:
                self.forget(pending)
                raise
        issued = _now()
        body = {
            "cmd_id": cmd_id,
            "issued_at": utc(issued),
            # whole seconds on the wire: round the expiry up so that a 1.5 s timeout is not 1 s
            "expires_at": utc(issued + timedelta(seconds=math.ceil(timeout_s + issued.microsecond / 1e6))),
            "args": args,
        }
        info = client.publish(
            topics.cmd(verb), self.envelope(topics.cmd(verb), json.dumps(body)), qos=1, properties=properties
        )
        if info.rc != 0:
            self.forget(pending)
            raise FleetError(f"publish to {topics.cmd(verb)} failed (paho rc {info.rc})")
        return pending

    def envelope(self, topic: str, text: str) -> bytes:
        """What goes on the wire to `topic`: `text` signed for it (see edgeserve.fleet.signed)."""
        return sign_command(self.command_key, topic, text) if self.command_key else text.encode()

    def set_desired(self, device: str, state: Json, timeout_s: float = 10.0) -> None:
        """Publish a device's desired state ({"generation": N, "bundle": {"url", "sha256"?}}), signed and
        retained: the device applies a generation once, when it is higher than the one it applied."""
        generation = state.get("generation")
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
            raise FleetError("a desired state needs a positive integer generation")
        topic = Topics(self.fleet, segment(device, "device")).desired
        info = self._require_client().publish(topic, self.envelope(topic, json.dumps(state)), 1, True)
        info.wait_for_publish(timeout_s)
        if info.rc != 0 or not info.is_published():
            raise FleetError(f"publish to {topic} failed or was not acknowledged (paho rc {info.rc})")

    def forget(self, pending: Pending) -> None:
        with self._lock:
            self._pending.pop(pending.cmd_id, None)
        if pending.unsubscribe and self._client is not None:
            self._client.unsubscribe(pending.unsubscribe)

    def send(
        self,
        device: str,
        verb: str,
        args: Json | None = None,
        timeout_s: float = 60.0,
        on_update: UpdateCallback | None = None,
        *,
        cmd_id: str | None = None,
    ) -> Json:
        """Send one command and wait for its final answer; `on_update` sees every answer as it comes
        (ACCEPTED, IN_PROGRESS..., the final one). No final answer in `timeout_s`: {"status": "TIMEOUT"}."""
        pending = self.issue(device, verb, args, timeout_s, cmd_id=cmd_id)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    _, body = (
                        pending.sink.get(timeout=max(0.0, left)) if left > 0 else pending.sink.get_nowait()
                    )
                except queue.Empty:
                    return timed_out(pending, timeout_s)
                pending.updates.append(body)
                if on_update is not None:
                    on_update(body)
                if body.get("status") in FINAL:
                    return body
        finally:
            self.forget(pending)

    def send_many(
        self,
        targets: dict[str, Json],
        verb: str,
        timeout_s: float,
        on_update: Callable[[str, Json], None] | None = None,
    ) -> dict[str, Json]:
        """The same verb to several devices at once ({device: args}) -> {device: final answer}."""
        return send_many(self, targets, verb, timeout_s, on_update)

    # -- staged rollout -----------------------------------------------------------------------------

    def deploy(self, url: str, *args: Any, **kwargs: Any) -> Json:
        """Staged rollout of a bundle; the arguments and their defaults are `Rollout.run`'s."""
        return Rollout(self).run(url, *args, **kwargs)

    def watch(self, on_message: WatchCallback, timeout_s: float = 10.0) -> Callable[[], None]:
        """Call `on_message(device, leaf, body, retained)` for every state/health/events/reported message
        of the fleet (the retained ones first); returns a function that stops the watch."""
        with self._lock:
            self._watchers.append(on_message)
        topics = [(Topics.fleet_wildcard(self.fleet, leaf), 1) for leaf in WATCH_LEAVES]
        self._subscribe(topics, timeout_s)  # subscribing again replays the retained messages

        def stop() -> None:
            with self._lock:
                if on_message in self._watchers:
                    self._watchers.remove(on_message)
                last = not self._watchers
            if last and self._client is not None:
                self._client.unsubscribe(Topics.fleet_wildcard(self.fleet, "events"))

        return stop
