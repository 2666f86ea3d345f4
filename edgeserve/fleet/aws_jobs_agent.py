"""The fleet agent on AWS IoT Jobs (`[fleet] protocol = "aws-iot-jobs"`): the same signed commands, run by
the same DeviceServices as the MQTT agent, delivered as job executions (contract in aws_jobs.py).

One execution at a time, as AWS hands them out (start-next). Outcomes map onto execution statuses:
a refused document (unsigned, unknown key, another device's or verb's signature, expired, malformed) is
REJECTED and never run; a command that ran and failed is FAILED with the reason; SUCCEEDED with the
result. Progress goes out as IN_PROGRESS updates (statusDetails: state, progress, message), each with
the execution's expectedVersion; a new step (a new install state) restarts the step timer
(stepTimeoutInMinutes). When the service ends the execution (TIMED_OUT, CANCELED, removed) the device
stops the work: the install is cancelled, and a bundle switched in after the job was gone is rolled back.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from datetime import datetime, timezone
from typing import Any

import paho.mqtt.client as mqtt

from edgeserve.fleet.agent_base import AgentBase
from edgeserve.fleet.aws_jobs import (
    DEFAULT_STEP_TIMEOUT_MIN,
    FAILED,
    IN_PROGRESS,
    MESSAGE_DEPTH,
    REJECTED,
    SUCCEEDED,
    TERMINAL,
    Execution,
    JobTopics,
    Updates,
    check_thing,
    details,
    execution_of,
    job_id_of,
    new_token,
    open_job,
)
from edgeserve.fleet.connection import connect, payload
from edgeserve.fleet.gate import command_keys
from edgeserve.fleet.jsonlimits import JsonRefused, loads_pruned
from edgeserve.fleet.ledger import INTERRUPTED, RUNNING, LedgerFull
from edgeserve.fleet.protocol import MAX_PAYLOAD_BYTES, CommandError, Topics
from edgeserve.fleet.services import FleetCommandFailed, execute
from edgeserve.logs import safe

log = logging.getLogger("edgeserve.fleet")

PROGRESS_EVERY_S = 2.0  # progress within one step, at most this often (AWS throttles updates per thing)


class JobsAgent(AgentBase):
    def _init_agent(self) -> None:
        settings = self.settings
        try:  # AWS IoT's name for it: [fleet] device_id is checked as one, the host name may not be one
            self.thing = check_thing(self.device)
        except ValueError as exc:
            raise ValueError(f"{exc}: set [fleet] device_id to the device's thing name") from None
        self.topics = JobTopics(self.thing)
        self.presence = Topics(settings.fleet, self.thing).state
        self.keys = command_keys(settings, self.trust)
        self._offers: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=16)
        self._lock = threading.Lock()
        self._running: Execution | None = None
        self._unsent: list[tuple[str, str, dict[str, str]]] = []  # finals to send at the next connect
        self._told: set[str] = set()  # executions whose final status the service took (this run)
        self._thread: threading.Thread | None = None
        self.updates = Updates(self.topics, self._publish, self.connected, self._stop)
        self._make_client(self.thing, self.presence)
        self._finish_interrupted()

    # -- lifetime ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._worker, name="aws-jobs", daemon=True)
        self._thread.start()
        keys = self.keys.current()
        if keys:
            log.info("fleet: %d trusted command key(s) in %s", len(keys), self.keys.folder)
        elif self.settings.require_signed_commands:
            log.error("fleet: no trusted command key (*.pub) in %s: every job is REJECTED until one is put "
                      "there (see ota/keys-policy.md)", self.keys.folder)  # fmt: skip
        connect(self.client, self.settings)
        log.info("fleet agent: AWS IoT Jobs for thing %s on %s", self.thing, self.settings.broker)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._running is not None:
                self._running.cancel.set()
        with contextlib.suppress(queue.Full):
            self._offers.put_nowait(None)
        self._goodbye(self.presence)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def state_changed(self) -> None:
        """The device changed: nothing to push here (the job execution carries every outcome)."""

    # -- MQTT -------------------------------------------------------------------------------------
    def _publish(self, topic: str, data: dict[str, Any], *, retain: bool = False) -> mqtt.MQTTMessageInfo:
        return self.client.publish(topic, payload(data), qos=1, retain=retain)

    def _on_accepted(self, client: mqtt.Client, flags: Any) -> None:
        for topic in self.topics.subscriptions():
            client.subscribe(topic, qos=1)
        self._publish(self.presence, self._online(), retain=True)
        with self._lock:
            unsent, self._unsent = self._unsent, []
        for job_id, status, status_details in unsent:  # no expectedVersion: the service has moved on since
            self._publish(self.topics.update(job_id), {"status": status, "statusDetails": status_details})
        self.connected.set()
        self._publish(self.topics.next_get, {"clientToken": new_token()})  # anything pending for us?

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:  # a bad message must never stop the network loop
            where = self.topics.parse(message.topic)
            if where is None:
                return
            # A document nested too deep is cut here, never parsed (json recurses): the execution still
            # reads, and its document is REJECTED with the reason, so the next job is not held behind it.
            data = message.payload or b"{}"
            body = loads_pruned(data, max_bytes=MAX_PAYLOAD_BYTES, max_depth=MESSAGE_DEPTH)
            if isinstance(body, dict):
                self._dispatch(where[0], where[1], body)
        except JsonRefused as exc:
            log.warning("fleet message on %s ignored: %s", safe(message.topic), safe(exc, 200))
        except Exception:
            log.exception("fleet message on %s could not be handled", safe(message.topic))

    def _dispatch(self, head: str, tail: str, body: dict[str, Any]) -> None:
        if tail in ("get/accepted", "get/rejected", "update/rejected"):
            self._check_gone(head, tail, body)  # before the waiting update wakes: it reads `gone`
        self.updates.answered(tail, body)
        if head == "notify-next" or (head == "$next" and tail == "get/accepted"):
            self._on_next(execution_of(body))
        elif head == "start-next" and tail == "accepted":
            execution = execution_of(body)
            if execution is not None:
                with contextlib.suppress(queue.Full):
                    self._offers.put_nowait(execution)

    def _on_next(self, execution: dict[str, Any] | None) -> None:
        """The next pending execution (or none). Idle: start it. Busy with another: is ours still on?"""
        with self._lock:
            running = self._running
        if running is not None and running.finished:
            return  # its final status is out: the worker asks for the next one itself, nothing about this
        if running is None:
            if execution is not None:
                self._start_next()
        elif execution is None or execution.get("jobId") != running.job_id:
            self._publish(self.topics.get(running.job_id), {"clientToken": new_token()})

    def _check_gone(self, head: str, tail: str, body: dict[str, Any]) -> None:
        with self._lock:
            running = self._running
        if running is None or head != running.job_id or running.gone:
            return
        state = body.get("execution") if tail == "get/accepted" else body.get("executionState")
        status = state.get("status") if isinstance(state, dict) else None
        code = body.get("code")
        if status in TERMINAL or code in (
            "ResourceNotFound",
            "InvalidStateTransition",
            "TerminalStateReached",
        ):
            running.gone = str(status or code)
            running.cancel.set()
            log.warning("job %s ended on the service side (%s): stopping it on the device", running.job_id,
                        safe(running.gone, 40))  # fmt: skip

    def _start_next(self) -> None:
        self._publish(self.topics.start_next, {"clientToken": new_token(), "stepTimeoutInMinutes":
                                               DEFAULT_STEP_TIMEOUT_MIN})  # fmt: skip

    # -- one execution at a time ------------------------------------------------------------------
    def _worker(self) -> None:
        while not self._stop.is_set():
            try:
                execution = self._offers.get(timeout=1.0)
            except queue.Empty:
                continue
            if execution is None:
                return
            try:
                self._handle(execution)
            except Exception:  # the agent survives whatever one job does
                log.exception("job execution could not be handled")
            if self.connected.is_set() and not self._stop.is_set():
                self._start_next()  # the next one, if any

    def _handle(self, execution: dict[str, Any]) -> None:
        try:
            job_id = job_id_of(execution)
        except CommandError as exc:
            log.warning("job execution ignored: %s", exc)
            return
        number = execution.get("executionNumber", 1)
        run = Execution(
            job_id,
            f"job:{job_id}:{number}",
            version if isinstance(version := execution.get("versionNumber"), int) else 0,
        )
        if run.key in self._told:  # offered twice (notify-next and our own start-next): done already
            return
        seen = self.ledger.get(run.key)
        if seen is not None:  # handled before: the service did not get our answer (or we restarted)
            if self.updates.update(run, str(seen.get("status")), dict(seen.get("details") or {})):
                self._told.add(run.key)
            return
        with self._lock:
            self._running = run
        try:
            self._run(run, execution)
        finally:
            with self._lock:
                self._running = None

    def _run(self, run: Execution, execution: dict[str, Any]) -> None:
        document = execution.get("jobDocument")
        try:
            job = open_job(document, thing=self.thing,
                           fleet=self.settings.fleet, keys=self.keys, now=datetime.now(timezone.utc),
                           require_signed=self.settings.require_signed_commands,
                           max_lifetime_s=self.settings.max_command_lifetime_s)  # fmt: skip
        except (CommandError, ValueError) as exc:
            log.warning("job %s REJECTED: %s", run.job_id, safe(exc, 300))
            self._final(run, REJECTED, reason=str(exc))
            return
        command = job.command
        run.step_min = job.step_timeout_min
        signer = f"signed by command key {job.key_id}" if job.key_id else "UNSIGNED (lab opt-out)"
        log.info("job %s: %s %s, %s", run.job_id, command.verb, command.cmd_id, signer)
        seen = self.ledger.get(command.cmd_id)
        if seen is not None:  # the same signed command in a second job: its first outcome, not a second run
            status = FAILED if seen.get("status") == RUNNING else str(seen.get("status"))
            self._final(run, status, reason=seen.get("error"), duplicate="true", cmd_id=command.cmd_id)
            return
        try:  # both kept until the command expires; nothing that arrives meanwhile pushes them out
            self.ledger.accept({command.cmd_id: {"verb": command.verb, "status": RUNNING, "job": run.key},
                                run.key: {"status": RUNNING, "job_id": run.job_id, "cmd_id": command.cmd_id}},
                               command.expires_at.timestamp())  # fmt: skip
        except LedgerFull as exc:
            self._final(run, REJECTED, reason=str(exc), cmd_id=command.cmd_id)
            return
        run.command, run.accepted = command, True
        accepted = details(state="ACCEPTED", cmd_id=command.cmd_id, verb=command.verb)
        self.updates.update(run, IN_PROGRESS, accepted, step=True)
        before = self._active_version() if command.verb == "deploy_bundle" else None
        try:
            result = execute(command, self.services, lambda s, p, m: self._progress(run, s, p, m), run.cancel,
                             cancel_command=_no_cancel, agent_status=self._agent_status)  # fmt: skip
        except FleetCommandFailed as exc:
            self._final(run, FAILED, reason=str(exc))
            return
        except Exception as exc:
            log.exception("job %s failed", run.job_id)
            self._final(run, FAILED, reason=f"internal error: {type(exc).__name__}: {exc}")
            return
        told = self._final(run, SUCCEEDED, **_result_details(result))
        if not told and run.gone and command.verb == "deploy_bundle":
            self._undo(run, before)

    def _progress(self, run: Execution, state: str, progress: float | None, message: str) -> None:
        now = time.monotonic()
        new_step = state != run.state
        if run.gone:  # the service has ended it: no more IN_PROGRESS, the work is being stopped
            return
        if not new_step and now - run.reported_at < PROGRESS_EVERY_S:
            return
        run.state, run.reported_at = state, now
        cmd_id = run.command.cmd_id if run.command else None
        status_details = details(state=state, progress=progress, message=message, cmd_id=cmd_id)
        self.updates.update(run, IN_PROGRESS, status_details, step=new_step)

    def _undo(self, run: Execution, before: int | None) -> None:
        """The bundle was switched in after the service ended the job: back to what served before it."""
        if before is None or self._active_version() == before:
            return
        try:
            self.services.rollback(before, lambda s, p, m: None)
            log.warning("job %s ended (%s) before its bundle was reported: rolled back to v%d", run.job_id,
                        run.gone, before)  # fmt: skip
        except Exception as exc:
            log.error("job %s ended (%s); rolling back to v%d failed: %s", run.job_id, run.gone, before, exc)

    def _final(self, run: Execution, status: str, **fields: Any) -> bool:
        """The terminal status, recorded before it is sent; True when the service took it. A refusal (or a
        duplicate) is remembered apart from the accepted commands: it never pushes one out of the ledger.
        An execution the service ended is told nothing more."""
        if run.command is not None:
            fields.setdefault("cmd_id", run.command.cmd_id)
        status_details = details(**fields)
        entry = {"status": status, "details": status_details, "job_id": run.job_id}
        run.finished = True
        if run.accepted and run.command is not None:
            self.ledger.record(run.key, entry)
            error = fields.get("reason") if status != SUCCEEDED else None
            outcome = {"verb": run.command.verb, "status": status, "error": error}
            self.ledger.record(run.command.cmd_id, outcome)
        else:
            self.ledger.refuse(run.key, entry)
        log.info("job %s: %s %s", run.job_id, status, safe(fields.get("reason", ""), 300))
        if run.gone:  # cancelled or timed out by the service: it refuses any status now
            log.info("job %s ended on the service side (%s): %s kept on the device only", run.job_id,
                     safe(run.gone, 40), status)  # fmt: skip
            return False
        answer = self.updates.update(run, status, status_details)
        if answer is True:
            self._told.add(run.key)
        elif answer is None:
            with self._lock:
                self._unsent.append((run.job_id, status, status_details))
        return answer is True

    # -- small state ------------------------------------------------------------------------------
    def _finish_interrupted(self) -> None:
        """Executions an earlier run started and never finished: FAILED (the installer's recovery at start
        undid whatever was half done), sent at the next connect."""
        for key, entry in self.ledger.interrupted():
            if key.startswith("job:"):
                status_details = details(cmd_id=entry.get("cmd_id"), reason=INTERRUPTED)
                self.ledger.record(key, {**entry, "status": FAILED, "details": status_details})
                self._unsent.append((str(entry.get("job_id")), FAILED, status_details))
            else:
                self.ledger.record(key, {**entry, "status": FAILED, "error": INTERRUPTED})

    def _active_version(self) -> int | None:
        try:
            version = self.services.status().get("active_version")
        except Exception:
            return None
        return version if isinstance(version, int) else None

    def _agent_status(self) -> dict[str, Any]:
        with self._lock:
            running = self._running.job_id if self._running else None
        return {"connected": self.connected.is_set(), "binding": "aws-iot-jobs", "running_job": running,
                "boot_id": self.boot_id}  # fmt: skip


def _result_details(result: dict[str, Any]) -> dict[str, Any]:
    keep = ("state", "reason", "name", "version", "active_version", "previous_version", "model", "removed")
    return {key: result[key] for key in keep if key in result}


def _no_cancel(cmd_id: str) -> dict[str, Any]:
    raise FleetCommandFailed("a job is cancelled with AWS IoT CancelJob / CancelJobExecution, not a command")
