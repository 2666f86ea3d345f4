"""Simulated device agents for the fleet manager's tests and the fleet simulation (benchmarks/fleet_sim.py).

Each SimAgent is one device with its OWN MQTT connection (paho-mqtt 2.x, MQTT 5 by default) and a will that
sets `state` {"online": false} retained. It follows edgeserve/fleet/protocol.py:

- at connect: retained `state` {"online": true, ...}, `info`, `health` {"status": "ok"}, `reported`;
- `cmd/deploy_bundle`: ACCEPTED, IN_PROGRESS (progress 0.5), then SUCCEEDED with the new version active and
  the old one previous (`reported` and `info` retained again, `events` for the transitions), or FAILED when
  the device is configured to fail (the version stays); takes `install_s`;
- `cmd/rollback` {to_version}: SUCCEEDED when the version is installed (it becomes active), FAILED otherwise;
- `cmd/get_status`: SUCCEEDED with the record; other verbs: SUCCEEDED after a short delay;
- a duplicate cmd_id gets the first outcome again (or the latest answer while it still runs);
- an expired or malformed command is REJECTED (protocol.parse_command);
- with `command_keys`, only commands signed by one of them for the topic they came on are run, the others
  REJECTED (edgeserve.fleet.signed, the device agent's own check); without, plain commands are taken;
- answers go to the MQTT 5 ResponseTopic with the CorrelationData, or to `resp/{cmd_id}`.

Timed steps run on one shared scheduler thread, so 200+ agents cost 200+ paho loop threads that mostly
sleep in select(), plus one. Run as a script (`python tests/fleet/sim_agent.py --broker ... --fleet ...
--device ...`) it is one agent in its own process, which a test can SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import random
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

from edgeserve.fleet.protocol import (  # noqa: E402
    ACCEPTED,
    FAILED,
    IN_PROGRESS,
    REJECTED,
    SUCCEEDED,
    CommandError,
    Topics,
    parse_command,
    utc,
)
from edgeserve.fleet.signed import open_envelope, peek_cmd_id  # noqa: E402
from edgeserve.ota.signing import TrustedKey  # noqa: E402


class Scheduler:
    """One thread that runs timed callbacks for every agent."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="sim-scheduler", daemon=True)
        self._thread.start()

    def later(self, delay_s: float, action: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._seq), action))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self._stopped:
                    return
                _, _, action = heapq.heappop(self._heap)
            try:
                action()
            except Exception as exc:  # a broken step must not stop the other agents
                print(f"sim scheduler: {exc!r}", file=sys.stderr)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()


_shared: Scheduler | None = None
_shared_lock = threading.Lock()


def shared_scheduler() -> Scheduler:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Scheduler()
        return _shared


class Reactor:
    """Many paho clients on ONE thread (paho's external-loop interface: loop_read/loop_write/loop_misc and
    the socket callbacks) with an epoll selector. paho's own loop_start uses select(), which cannot watch
    file descriptors above 1023 (each client costs 3 fds), so past ~330 agents in one process the agents
    go on a Reactor. No automatic reconnect here (the benchmark does not restart the broker)."""

    def __init__(self) -> None:
        import selectors
        import socket

        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._todo: list[tuple[str, Any, Any]] = []
        self._clients: dict[Any, Any] = {}  # socket -> client
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="sim-reactor", daemon=True)
        self._thread.start()

    def attach(self, client: Any) -> None:
        client.on_socket_open = lambda c, u, sock: self._queue("open", c, sock)
        client.on_socket_close = lambda c, u, sock: self._queue("close", c, sock)
        client.on_socket_register_write = lambda c, u, sock: self._queue("write", c, sock)
        client.on_socket_unregister_write = lambda c, u, sock: None  # the reactor checks want_write()

    def _queue(self, what: str, client: Any, sock: Any) -> None:
        with self._lock:
            self._todo.append((what, client, sock))
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    def _apply(self) -> None:
        import selectors

        with self._lock:
            todo, self._todo = self._todo, []
        for what, client, sock in todo:
            if what == "open":
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._sel.register(sock, selectors.EVENT_READ, client)
                    self._clients[sock] = client
            elif what == "close":
                self._clients.pop(sock, None)
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._sel.unregister(sock)
            if what in ("open", "write") and sock in self._clients and client.want_write():
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)

    def _run(self) -> None:
        import selectors

        last_misc = time.monotonic()
        while not self._stopped:
            self._apply()
            for key, mask in self._sel.select(timeout=0.5):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._wake_r.recv(4096)
                    continue
                client = key.data
                if mask & selectors.EVENT_READ:
                    client.loop_read()
                if mask & selectors.EVENT_WRITE:
                    client.loop_write()
                sock = key.fileobj
                if sock in self._clients and not client.want_write():
                    with contextlib.suppress(KeyError, ValueError, OSError):
                        self._sel.modify(sock, selectors.EVENT_READ, client)
            if time.monotonic() - last_misc >= 1.0:
                last_misc = time.monotonic()
                for client in list(self._clients.values()):
                    client.loop_misc()

    def detach(self, client: Any) -> None:
        sock = client.socket()
        if sock is not None:
            self._queue("close", client, sock)

    def stop(self) -> None:
        self._stopped = True
        self._queue("wake", None, None)


@dataclass
class SimConfig:
    install_s: float = 0.3
    fail: bool = False  # every deploy_bundle FAILS (health check), the old version stays
    fail_probability: float = 0.0  # or: fails with this probability, deterministic per (seed, device, url)
    seed: int = 0
    rollback_s: float = 0.1
    silent: bool = False  # accepts nothing: never answers (for timeouts)


@dataclass
class SimAgent:
    broker_url: str
    fleet: str
    device: str
    config: SimConfig = field(default_factory=SimConfig)
    active_version: int | None = 1
    previous_version: int | None = None
    protocol: str = "5"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: str | None = None
    scheduler: Scheduler | None = None
    reactor: Reactor | None = None  # None: paho's loop_start (one thread per agent)
    command_keys: dict[str, TrustedKey] | None = None  # None: unsigned commands (the benchmark)

    def __post_init__(self) -> None:
        self.topics = Topics(self.fleet, self.device)
        self.boot_id = uuid.uuid4().hex
        self.generation = 0
        self.installed: set[int] = {v for v in (self.active_version, self.previous_version) if v is not None}
        self.lock = threading.Lock()
        self.outcomes: dict[str, dict[str, Any]] = {}  # cmd_id -> latest answer (final when done)
        self.received: list[tuple[str, dict[str, Any]]] = []  # (verb, body) of every command seen
        self.refused: list[str] = []  # why each command that failed the signature check was refused
        self.published = 0  # PUBLISH packets this agent sent (the benchmark checks the broker's count)
        self.connected = threading.Event()
        self.client: Any = None
        self.sched = self.scheduler or shared_scheduler()

    # -- connection ---------------------------------------------------------------------------------

    def start(self, wait_s: float = 10.0) -> SimAgent:
        host_port = self.broker_url.split("://", 1)[-1]
        host, _, port = host_port.partition(":")
        tls = self.broker_url.startswith("mqtts://")
        mqtt5 = self.protocol == "5"
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"{self.fleet}.{self.device}",
            protocol=mqtt.MQTTv5 if mqtt5 else mqtt.MQTTv311,
        )
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        if tls:
            client.tls_set(ca_certs=self.ca_file, certfile=self.cert_file, keyfile=self.key_file)
        client.will_set(self.topics.state, json.dumps({"online": False}), qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        client.reconnect_delay_set(0.2, 2)
        self.client = client
        if self.reactor is not None:
            self.reactor.attach(client)
        client.connect(host, int(port or (8883 if tls else 1883)), keepalive=30)
        if self.reactor is None:
            client.loop_start()
        if wait_s and not self.connected.wait(wait_s):
            raise RuntimeError(f"sim agent {self.device} did not connect")
        return self

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if getattr(reason_code, "is_failure", False):
            return
        client.subscribe(self.topics.cmd("+"), qos=1)
        self._publish_retained()
        self.connected.set()

    def _publish_retained(self) -> None:
        now = utc(datetime.now(timezone.utc))
        self._pub(
            self.topics.state, {"online": True, "boot_id": self.boot_id, "version": "0.1.0", "at": now}, True
        )
        self._pub(self.topics.info, self._info(), True)
        self._pub(self.topics.health, {"status": "ok", "checks": [{"name": "sim", "ok": True}]}, True)
        self._pub(self.topics.reported, self._reported(), True)

    def _info(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "fleet": self.fleet,
            "edgeserve": "0.1.0",
            "hardware": {"arch": "x86_64", "accelerator": "sim"},
            "backends": {"mlp": "onnxruntime"},
            "bundle": {
                "active_version": self.active_version,
                "previous_version": self.previous_version,
                "name": "sim-bundle",
            },
        }

    def _reported(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "active_version": self.active_version,
            "previous_version": self.previous_version,
            "models": ["mlp"],
            "phase": "idle",
        }

    def _pub(self, topic: str, body: dict[str, Any], retain: bool = False, properties: Any = None) -> None:
        if self.client is not None:
            self.client.publish(topic, json.dumps(body), qos=1, retain=retain, properties=properties)
            self.published += 1

    def stop(self) -> None:
        """A clean shutdown: `state` offline (retained), DISCONNECT (no will)."""
        client, self.client = self.client, None
        if client is None:
            return
        client.publish(self.topics.state, json.dumps({"online": False}), qos=1, retain=True).wait_for_publish(
            5
        )
        client.disconnect()
        client.loop_stop()

    def crash(self) -> None:
        """Drop the TCP connection without DISCONNECT (the broker publishes the will)."""
        client, self.client = self.client, None
        if client is None:
            return
        client.loop_stop()
        if self.reactor is not None:
            self.reactor.detach(client)
        sock = client.socket()
        if sock is not None:
            import socket as socketlib

            with contextlib.suppress(OSError):
                sock.shutdown(socketlib.SHUT_RDWR)
            sock.close()

    # -- commands -----------------------------------------------------------------------------------

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        verb = msg.topic.rsplit("/", 1)[-1]
        props = msg.properties
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation = getattr(props, "CorrelationData", None) if props is not None else None
        payload = msg.payload
        if self.command_keys is not None:
            try:
                payload = open_envelope(msg.topic, msg.payload, self.command_keys).text.encode()
            except CommandError as exc:
                cmd_id = peek_cmd_id(msg.payload)
                with self.lock:
                    self.refused.append(str(exc))
                key = cmd_id if isinstance(cmd_id, str) else "invalid"
                self._replier(key, response_topic, correlation)(
                    {"status": REJECTED, "error": str(exc)}, False
                )
                return
        try:
            body = json.loads(payload)
        except ValueError:
            body = {}
        cmd_id = body.get("cmd_id") if isinstance(body, dict) else None
        with self.lock:
            self.received.append((verb, body if isinstance(body, dict) else {}))
            first = self.outcomes.get(cmd_id) if isinstance(cmd_id, str) else None
        reply = self._replier(cmd_id if isinstance(cmd_id, str) else "invalid", response_topic, correlation)
        if first is not None:  # duplicate: the first outcome again
            reply(dict(first), remember=False)
            return
        if self.config.silent:
            return
        try:
            command = parse_command(verb, payload)
        except CommandError as exc:
            reply({"status": REJECTED, "error": str(exc)})
            return
        reply({"status": ACCEPTED})
        if verb == "deploy_bundle":
            self._deploy(command.args, reply)
        elif verb == "rollback":
            self.sched.later(
                self.config.rollback_s, lambda: self._rollback(int(command.args["to_version"]), reply)
            )
        elif verb == "get_status":
            reply({"status": SUCCEEDED, "result": self._status()})
        else:
            self.sched.later(0.05, lambda: reply({"status": SUCCEEDED, "result": {"verb": verb}}))

    def _replier(
        self, cmd_id: str, response_topic: str | None, correlation: bytes | None
    ) -> Callable[..., None]:
        def reply(answer: dict[str, Any], remember: bool = True) -> None:
            answer = {"cmd_id": cmd_id, **answer}
            if remember:
                with self.lock:
                    self.outcomes[cmd_id] = answer
            if response_topic:
                properties = Properties(PacketTypes.PUBLISH)
                if correlation is not None:
                    properties.CorrelationData = correlation
                self._pub(response_topic, answer, properties=properties)
            else:
                self._pub(self.topics.resp(cmd_id), answer)

        return reply

    def _fails(self, url: str) -> bool:
        if self.config.fail:
            return True
        if self.config.fail_probability <= 0:
            return False
        return (
            random.Random(f"{self.config.seed}:{self.device}:{url}").random() < self.config.fail_probability
        )

    @staticmethod
    def _version_of(url: str, current: int | None) -> int:
        found = re.findall(r"v(\d+)", url.rsplit("/", 1)[-1])
        return int(found[-1]) if found else (current or 0) + 1

    def _event(self, state: str, version: int | None, **extra: Any) -> None:
        self._pub(
            self.topics.events,
            {"state": state, "version": version, "at": utc(datetime.now(timezone.utc)), **extra},
        )

    def _deploy(self, args: dict[str, Any], reply: Callable[..., None]) -> None:
        url = str(args["url"])
        new = self._version_of(url, self.active_version)
        install_s = self.config.install_s
        self._event("downloading", new, url=url)

        def halfway() -> None:
            reply({"status": IN_PROGRESS, "progress": 0.5, "message": f"installing v{new}"})
            self._event("installing", new)

        def finish() -> None:
            if self._fails(url):
                self._event("rolled_back", new, error="health check failed")
                reply(
                    {
                        "status": FAILED,
                        "error": f"v{new}: health check failed (simulated); v{self.active_version} kept",
                    }
                )
                return
            with self.lock:
                old = self.active_version
                self.previous_version, self.active_version = old, new
                self.installed.add(new)
                self.generation += 1
            self._pub(self.topics.reported, self._reported(), True)
            self._pub(self.topics.info, self._info(), True)
            self._event("committed", new)
            reply({"status": SUCCEEDED, "result": {"active_version": new, "previous_version": old}})

        self.sched.later(install_s / 2, halfway)
        self.sched.later(install_s, finish)

    def _rollback(self, to_version: int, reply: Callable[..., None]) -> None:
        with self.lock:
            if to_version not in self.installed:
                ok = False
            else:
                ok = True
                if to_version != self.active_version:
                    self.previous_version, self.active_version = self.active_version, to_version
                self.generation += 1
        if not ok:
            reply({"status": FAILED, "error": f"version {to_version} is not installed"})
            return
        self._pub(self.topics.reported, self._reported(), True)
        self._pub(self.topics.info, self._info(), True)
        self._event("rolled_back", to_version, manual=True)
        reply(
            {
                "status": SUCCEEDED,
                "result": {"active_version": self.active_version, "previous_version": self.previous_version},
            }
        )

    def _status(self) -> dict[str, Any]:
        return {"device": self.device, **self._reported(), "boot_id": self.boot_id}

    def verbs(self) -> list[str]:
        with self.lock:
            return [verb for verb, _ in self.received]


class SimFleet:
    """Many SimAgents (each with its own connection) started and stopped together."""

    def __init__(self, broker_url: str, fleet: str, **options: Any) -> None:
        self.broker_url, self.fleet, self.options = broker_url, fleet, options
        self.agents: dict[str, SimAgent] = {}

    def add(
        self, devices: Iterable[str], config: SimConfig | None = None, **overrides: Any
    ) -> list[SimAgent]:
        started = []
        for device in devices:
            options = {**self.options, **overrides}
            agent = SimAgent(self.broker_url, self.fleet, device, config or SimConfig(), **options)
            agent.start(wait_s=0)
            self.agents[device] = agent
            started.append(agent)
        for agent in started:
            if not agent.connected.wait(30):
                raise RuntimeError(f"sim agent {agent.device} did not connect")
        return started

    def __getitem__(self, device: str) -> SimAgent:
        return self.agents[device]

    def stop(self) -> None:
        for agent in self.agents.values():
            try:
                agent.stop()
            except Exception:
                agent.crash()
        self.agents.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one simulated edgeserve device agent")
    parser.add_argument("--broker", required=True)
    parser.add_argument("--fleet", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument("--install-s", type=float, default=0.3)
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args(argv)
    agent = SimAgent(
        args.broker,
        args.fleet,
        args.device,
        SimConfig(install_s=args.install_s, fail=args.fail),
        active_version=args.version,
    ).start()
    print("ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
