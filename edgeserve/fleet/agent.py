"""The device's fleet agent: commands in, answers, state, events, health and metrics out.

It lives in the supervisor, so it stays connected while the server restarts. Threads, each with one
job and stopped by `stop()`: paho's network loop (never blocked by a command), `fleet-long` (one long
command at a time, the others queued up to a bound), `fleet-short` (get_status, cancel), and
`fleet-pump` (sends buffered events in order, state, health, metrics).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.subscribeoptions import SubscribeOptions

from edgeserve.fleet.agent_base import AgentBase, utc_now
from edgeserve.fleet.connection import connect, payload, publish_properties
from edgeserve.fleet.desired import DesiredRefused, parse_desired
from edgeserve.fleet.gate import CommandGate
from edgeserve.fleet.gate import Reply as _Reply
from edgeserve.fleet.jsonlimits import JsonRefused, loads
from edgeserve.fleet.ledger import RUNNING, LedgerFull, hex_or_none
from edgeserve.fleet.persist import Generation, Outbox
from edgeserve.fleet.protocol import (
    ACCEPTED,
    FAILED,
    IN_PROGRESS,
    LONG_VERBS,
    MAX_PAYLOAD_BYTES,
    REJECTED,
    SUCCEEDED,
    Command,
    CommandError,
    Topics,
    parse_command,
)
from edgeserve.fleet.services import FleetCommandFailed, Report, execute
from edgeserve.logs import safe

log = logging.getLogger("edgeserve.fleet")


@dataclass
class _Job:
    command: Command
    reply: _Reply
    cancel: threading.Event = field(default_factory=threading.Event)


class FleetAgent(AgentBase):
    def _init_agent(self) -> None:
        settings = self.settings
        self.topics = Topics(settings.fleet, self.device)
        # Command keys: [fleet] command_keys, else <trust_dir>/commands, less the keys the fleet revoked.
        self.gate = CommandGate(settings, self.topics, self.trust)
        self.v5 = settings.protocol == "5"
        self.outbox = Outbox(self.folder)
        self._generation = Generation(self.folder / "applied.json")
        self._max_jobs = settings.max_queued_commands + 1  # the running one and those waiting
        self._long: queue.Queue[_Job | None] = queue.Queue(maxsize=self._max_jobs + 1)
        self._short: queue.Queue[_Job | None] = queue.Queue(maxsize=64)
        self._jobs: dict[str, _Job] = {}  # queued or running long commands, by cmd_id
        self._jobs_lock = threading.Lock()
        self._running: _Job | None = None
        self._last_health: dict[str, Any] | None = None
        self._reported_dirty = threading.Event()
        self._info_due = threading.Event()
        self._pending_replies: list[tuple[_Reply, dict[str, Any]]] = []
        self._threads: list[threading.Thread] = []
        self._make_client(f"edgeserve-{settings.fleet}-{self.device}", self.topics.state)
        self._finish_interrupted()

    # -- lifetime ---------------------------------------------------------------------------------
    def start(self) -> None:
        for name, target in (
            ("fleet-long", self._long_worker),
            ("fleet-short", self._short_worker),
            ("fleet-pump", self._pump),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self.gate.describe()
        connect(self.client, self.settings)
        log.info(
            "fleet agent: device %s of fleet %s on %s", self.device, self.settings.fleet, self.settings.broker
        )

    def stop(self) -> None:
        """Say goodbye (retained offline state), stop every thread."""
        self._stop.set()
        with self._jobs_lock:
            for job in self._jobs.values():
                job.cancel.set()
        for q in (self._long, self._short):
            with contextlib.suppress(queue.Full):
                q.put_nowait(None)
        self._goodbye(self.topics.state)
        for thread in self._threads:
            thread.join(timeout=5)

    def state_changed(self) -> None:
        """The device changed (models, readiness, bundle): re-send reported and health soon."""
        self._reported_dirty.set()

    # -- connection -------------------------------------------------------------------------------
    def _on_accepted(self, client: mqtt.Client, flags: Any) -> None:
        if self.v5:  # keep the retain flag as published: a retained command is refused even when live
            client.subscribe(self.topics.cmd("+"), options=SubscribeOptions(qos=1, retainAsPublished=True))
        else:
            client.subscribe(self.topics.cmd("+"), qos=1)
        client.subscribe(self.topics.desired, qos=1)
        self._publish(self.topics.state, self._online(), retain=True)
        self.connected.set()
        self._reported_dirty.set()
        self._last_health = None  # re-send health and info at every connect
        self._info_due.set()
        log.info("fleet broker connected (session present: %s)", getattr(flags, "session_present", "?"))

    def _publish(
        self,
        topic: str,
        data: dict[str, Any],
        *,
        qos: int = 1,
        retain: bool = False,
        expiry_s: int | None = None,
        correlation: bytes | None = None,
    ) -> mqtt.MQTTMessageInfo:
        properties = publish_properties(expiry_s, correlation) if self.v5 else None
        return self.client.publish(topic, payload(data), qos=qos, retain=retain, properties=properties)

    # -- commands in ------------------------------------------------------------------------------
    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:  # nothing reaches a handler unless the gate verified it (signature, topic, lifetime)
            ok = self.gate.admit(message, datetime.now(timezone.utc))  # logs and remembers a refusal
            if ok.error is not None and message.topic == self.topics.desired:
                self._reported_dirty.set()  # reported, as every desired state's outcome is
            elif ok.error is not None:
                self._answer(self._reply_to(message, ok.cmd_id), ok.cmd_id, REJECTED, error=ok.error)
            elif ok.message is not None and message.topic == self.topics.desired:
                self._on_desired(ok.message)
            elif ok.message is not None:
                self._on_command(ok.message)
        except Exception:  # a bad message must never stop the network loop
            log.exception("fleet message on %s could not be handled", safe(message.topic))

    def _reply_to(self, message: mqtt.MQTTMessage, cmd_id: str | None) -> _Reply | None:
        return self.gate.reply_to(message, cmd_id)

    def _on_command(self, message: mqtt.MQTTMessage) -> None:
        verb = message.topic[len(self.topics.cmd("")) :]
        try:
            raw = loads(message.payload, max_bytes=MAX_PAYLOAD_BYTES)
            raw_id = raw.get("cmd_id") if isinstance(raw, dict) else None
        except JsonRefused:  # parse_command below says why
            raw, raw_id = None, None
        cmd_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= 128 else None
        reply = self._reply_to(message, cmd_id)
        if message.retain:  # a retained rollback would replay at every reconnect
            return self._answer(
                reply, cmd_id, REJECTED, error="retained commands are never run; publish without retain"
            )
        if isinstance(raw, dict) and raw.get("device") not in (None, self.device):
            return self._answer(
                reply,
                cmd_id,
                REJECTED,
                error=f"command for device {safe(raw.get('device'), 64)}, this is {self.device}",
            )
        try:
            command = parse_command(verb, message.payload)
        except CommandError as exc:
            log.info("fleet command %s on %s rejected: %s", safe(cmd_id), safe(verb), safe(exc, 400))
            return self._answer(reply, cmd_id, REJECTED, error=str(exc))
        assert reply is not None
        seen = self.ledger.get(command.cmd_id)
        if seen is not None:  # delivered again (QoS 1) or sent twice: the first outcome, not a second run
            status = seen.get("status")
            if status == RUNNING:
                return self._answer(reply, command.cmd_id, IN_PROGRESS, duplicate=True)
            return self._answer(
                reply,
                command.cmd_id,
                str(status),
                duplicate=True,
                **{k: seen[k] for k in ("result", "error") if k in seen},
            )
        job = _Job(command, reply)
        if command.verb in LONG_VERBS:
            self._enqueue_long(job)
        else:
            try:
                self._short.put_nowait(job)
            except queue.Full:
                self._answer(reply, command.cmd_id, REJECTED, error="busy: too many status requests")

    def _enqueue_long(self, job: _Job) -> None:
        cmd_id = job.command.cmd_id
        with self._jobs_lock:
            if len(self._jobs) >= self._max_jobs:
                running = self._running.command.cmd_id if self._running else "-"
                waiting = len(self._jobs) - (1 if self._running else 0)
                self._answer(job.reply, cmd_id, REJECTED,
                             error=f"busy: {running} runs and {waiting} command(s) wait")  # fmt: skip
                return
            # Recorded before the worker can see it: the final outcome is always written after this. Kept
            # until the command expires; at the ledger's cap it is refused, never a live one forgotten.
            entry = {"verb": job.command.verb, "status": RUNNING, "reply": job.reply.topic,
                     "correlation": hex_or_none(job.reply.correlation)}  # fmt: skip
            try:
                self.ledger.accept({cmd_id: entry}, job.command.expires_at.timestamp())
            except LedgerFull as exc:
                self._answer(job.reply, cmd_id, REJECTED, error=str(exc))
                return
            ahead = len(self._jobs)
            self._jobs[cmd_id] = job
            self._answer(job.reply, cmd_id, ACCEPTED, queued_behind=ahead)
            self._long.put_nowait(job)

    def _on_desired(self, message: mqtt.MQTTMessage) -> None:
        try:
            desired = parse_desired(message.payload)
        except DesiredRefused as exc:  # told to the fleet in `reported`; nothing else changes
            self.gate.refuse_desired(str(exc))
            log.warning("fleet: %s; ignored", safe(exc, 200))
            self._reported_dirty.set()
            return
        if desired is None:  # the manager cleared its retained desired state
            return
        generation = desired.generation
        if generation <= self._generation.read().get("generation", 0):
            self._reported_dirty.set()
            return
        if desired.url is None:
            self._generation.write(generation, "ignored: no bundle.url in the desired state")
            self._reported_dirty.set()
            return
        now = datetime.now(timezone.utc)
        args = {"url": desired.url, "sha256": desired.sha256, "generation": generation}
        # Remembered as long as a command could be (a generation that failed is not retried at every
        # reconnect meanwhile; the applied generation guards it after that).
        until = now + timedelta(seconds=self.settings.max_command_lifetime_s)
        command = Command(f"desired-{generation}", "deploy_bundle", now, until, args)
        if self.ledger.get(command.cmd_id) is None:
            self._enqueue_long(_Job(command, _Reply(self.topics.resp(command.cmd_id))))

    # -- commands run -----------------------------------------------------------------------------
    def _long_worker(self) -> None:
        while not self._stop.is_set():
            job = self._long.get()
            if job is None:
                return
            with self._jobs_lock:
                self._running = job
            try:
                self._run(job)
            finally:
                with self._jobs_lock:
                    self._running = None
                    self._jobs.pop(job.command.cmd_id, None)
                self._reported_dirty.set()

    def _short_worker(self) -> None:
        while not self._stop.is_set():
            job = self._short.get()
            if job is None:
                return
            self._run(job)

    def _run(self, job: _Job) -> None:
        command = job.command
        if job.cancel.is_set():
            return self._final(job, FAILED, error="cancelled before it started")
        last: dict[str, Any] = {"at": 0.0, "state": ""}

        def report(state: str, progress: float | None, message: str) -> None:
            now = time.monotonic()
            if state != last["state"]:
                self.outbox.add(
                    self.topics.events,
                    {"cmd_id": command.cmd_id, "state": state, "message": message, "at": utc_now()},
                )
            if state != last["state"] or now - float(last["at"]) >= 1.0:
                last["at"], last["state"] = now, state
                self._answer(
                    job.reply, command.cmd_id, IN_PROGRESS, progress=progress, state=state, message=message
                )

        try:
            result = self._execute(command, report, job.cancel)
        except FleetCommandFailed as exc:
            return self._final(job, FAILED, error=str(exc))
        except Exception as exc:  # the agent survives any failure of a command
            log.exception("fleet command %s failed", command.cmd_id)
            return self._final(job, FAILED, error=f"internal error: {type(exc).__name__}: {exc}")
        self._final(job, SUCCEEDED, result=result)

    def _execute(self, command: Command, report: Report, cancel: threading.Event) -> dict[str, Any]:
        result = execute(command, self.services, report, cancel, cancel_command=self._cancel,
                         agent_status=self._agent_status)  # fmt: skip
        if command.verb == "deploy_bundle" and "generation" in command.args:
            self._generation.write(int(command.args["generation"]), "applied")
            self._reported_dirty.set()
        elif command.verb == "revoke_key":  # info and health say what is trusted now
            self._info_due.set()
            self._reported_dirty.set()
        return result

    def _cancel(self, cmd_id: str) -> dict[str, Any]:
        with self._jobs_lock:
            job = self._jobs.get(cmd_id)
            running = self._running is job and job is not None
        if job is None:
            raise FleetCommandFailed(f"no queued or running command {cmd_id}")
        job.cancel.set()
        return {"cancelled": cmd_id, "was": "running" if running else "queued"}

    def _final(self, job: _Job, status: str, **fields: Any) -> None:
        cmd_id = job.command.cmd_id
        if job.command.verb in LONG_VERBS:
            self.ledger.record(cmd_id, {"verb": job.command.verb, "status": status, **fields})
        self._answer(job.reply, cmd_id, status, **fields)
        log.info("fleet command %s (%s): %s %s", safe(cmd_id), job.command.verb, status,
                 safe(fields.get("error", ""), 400))  # fmt: skip

    def _answer(self, reply: _Reply | None, cmd_id: str | None, status: str, **fields: Any) -> None:
        if reply is not None and not self.gate.may_publish(reply.topic):  # e.g. an old ledger's reply topic
            reply = self.gate.reply_to(mqtt.MQTTMessage(), cmd_id)
        if reply is None:  # no cmd_id and no ResponseTopic: nobody to tell
            log.warning("fleet: a command without cmd_id or ResponseTopic was %s: %s", status,
                        safe(fields.get("error"), 400))  # fmt: skip
            return
        body = {"cmd_id": cmd_id, "device": self.device, "status": status, "at": utc_now(), **fields}
        self._publish(reply.topic, body, correlation=reply.correlation)

    def _finish_interrupted(self) -> None:
        """Commands an earlier run accepted and never finished: FAILED (the installer's recovery at
        start undid whatever was half done), answered as soon as the broker is back."""
        for topic, correlation, answer in self.ledger.fail_interrupted():
            reply = _Reply(topic or self.topics.resp(answer["cmd_id"]), correlation)
            self._pending_replies.append((reply, answer))

    # -- state out --------------------------------------------------------------------------------
    def _pump(self) -> None:
        next_metrics = 0.0
        while not self._stop.wait(0.2):
            if not self.connected.is_set():
                continue
            while self._pending_replies:
                reply, body = self._pending_replies.pop(0)
                self._answer(reply, body.pop("cmd_id"), body.pop("status"), **body)
            self._flush_events()
            if self._info_due.is_set():  # the broker may have lost it: at once after every connect
                self._publish_info()
            now = time.monotonic()
            if self._reported_dirty.is_set():
                self._reported_dirty.clear()
                self._publish_reported()
                self._publish_health()
            if now >= next_metrics:
                next_metrics = now + self.settings.metrics_interval_s
                self._publish_health_and_metrics()

    def _flush_events(self) -> None:
        while self.connected.is_set() and not self._stop.is_set():
            entry = self.outbox.peek()
            if entry is None:
                return
            info = self._publish(entry["topic"], {**entry["payload"], "seq": entry["seq"]})
            try:
                info.wait_for_publish(5)
            except (RuntimeError, ValueError):
                return
            if not info.is_published():
                return  # not acknowledged yet: the same event first, next round
            self.outbox.ack(int(entry["seq"]))

    def _publish_reported(self) -> None:
        try:
            status = self.services.status()
        except Exception as exc:
            status = {"error": f"{type(exc).__name__}: {exc}"}
        applied = self._generation.read()
        running = self._running.command.cmd_id if self._running else None
        self._publish(
            self.topics.reported,
            {
                **status,
                "generation": applied.get("generation", 0),
                "generation_outcome": applied.get("outcome", ""),
                "desired_rejected": self.gate.desired_rejected,
                "running": running,
                "queued": self._long.qsize(),
                "at": utc_now(),
            },
            retain=True,
        )

    def _publish_info(self) -> None:
        self._info_due.clear()
        identity = {"device": self.device, "fleet": self.settings.fleet, "edgeserve": self.version}
        with contextlib.suppress(Exception):
            self._publish(self.topics.info, {**identity, "boot_id": self.boot_id, **self.services.info()},
                          retain=True)  # fmt: skip

    def _publish_health_and_metrics(self) -> None:
        self._publish_health()
        try:
            metrics = self.services.metrics()
        except Exception as exc:
            metrics = {"error": str(exc)}
        expiry = int(self.settings.metrics_interval_s * 2) + 1
        self._publish(self.topics.metrics, {**metrics, "at": utc_now()}, qos=0, expiry_s=expiry)

    def _publish_health(self) -> None:
        try:
            health = self.services.health()
        except Exception as exc:
            health = {"status": "failing", "checks": [f"health probe failed: {exc}"]}
        if health != self._last_health:
            self._last_health = health
            self._publish(self.topics.health, {**health, "at": utc_now()}, retain=True)

    # -- small state ------------------------------------------------------------------------------
    def _agent_status(self) -> dict[str, Any]:
        with self._jobs_lock:
            running = self._running.command.cmd_id if self._running else None
        return {
            "connected": self.connected.is_set(),
            "running": running,
            "queued": self._long.qsize(),
            "events_buffered": len(self.outbox),
            "events_dropped": self.outbox.dropped,
            "boot_id": self.boot_id,
        }
