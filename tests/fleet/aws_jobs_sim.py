"""A simulator of the AWS IoT Jobs service side of its documented MQTT contract, on a local Mosquitto
(the real service cannot be reached from here). It answers what a device publishes under
`$aws/things/{thing}/jobs/` the way the AWS IoT Jobs developer guide describes:

- `notify-next` is published whenever a thing's next pending execution changes (or there is none);
- `$next/get` and `{jobId}/get` answer `.../accepted` {execution} or `.../rejected` {code, message};
- `start-next` moves the next pending execution (IN_PROGRESS ones first, then QUEUED in queue order) to
  IN_PROGRESS, starts its step timer (stepTimeoutInMinutes) and answers `start-next/accepted`;
- `{jobId}/update` checks expectedVersion (VersionMismatch), the transition (InvalidStateTransition from
  a terminal status), that statusDetails are string values (InvalidRequest), bumps versionNumber,
  restarts the step timer when stepTimeoutInMinutes is given, and answers with executionState;
- a step timer that runs out makes the execution TIMED_OUT.

`minute_s` is how long a simulated minute lasts (tests use a second). Every update is kept for asserts,
and every DescribeJobExecution (`{jobId}/get`, `$next/get`) with the status the job had when it was asked.
A document may be given as its JSON text (`RawDocument`): one nested deeper than Python's json can write.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

TERMINAL = {"SUCCEEDED", "FAILED", "REJECTED", "TIMED_OUT", "CANCELED", "REMOVED"}
DEVICE_STATUSES = {"IN_PROGRESS", "SUCCEEDED", "FAILED", "REJECTED"}


@dataclass(frozen=True)
class RawDocument:
    """A job document as the JSON text the service hands out (spliced into its messages as it is)."""

    text: str


@dataclass
class Execution:
    job_id: str
    thing: str
    document: dict[str, Any] | RawDocument
    queued_at: float
    status: str = "QUEUED"
    status_details: dict[str, str] = field(default_factory=dict)
    version: int = 1
    number: int = 1
    deadline: float | None = None  # monotonic end of the step timer
    updates: list[dict[str, Any]] = field(default_factory=list)  # every update request, as sent
    rejections: list[str] = field(default_factory=list)  # codes of refused updates
    refused_updates: list[dict[str, Any]] = field(default_factory=list)  # those sent after it ended

    def public(self, with_document: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "jobId": self.job_id,
            "thingName": self.thing,
            "status": self.status,
            "statusDetails": dict(self.status_details),
            "queuedAt": int(self.queued_at),
            "lastUpdatedAt": int(time.time()),
            "versionNumber": self.version,
            "executionNumber": self.number,
        }
        if with_document:
            out["jobDocument"] = self.document
        return out


class JobsSimulator:
    def __init__(self, port: int, *, minute_s: float = 60.0) -> None:
        self.minute_s = minute_s
        self._lock = threading.RLock()
        self._executions: dict[str, list[Execution]] = {}  # thing -> in creation order
        self.queries: list[tuple[str, str]] = []  # (jobId or "$next", its status then) per get, in order
        self._stop = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"aws-jobs-{uuid.uuid4().hex[:6]}",
                                  protocol=mqtt.MQTTv311)  # fmt: skip
        self.client.on_message = self._on_message
        ready = threading.Event()
        self.client.on_subscribe = lambda *args: ready.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe("$aws/things/+/jobs/#", qos=1)
        if not ready.wait(10):
            raise RuntimeError("the simulator could not subscribe")
        self._timer = threading.Thread(target=self._timers, daemon=True)
        self._timer.start()

    def close(self) -> None:
        self._stop.set()
        self.client.disconnect()
        self.client.loop_stop()

    # -- the operator's side ----------------------------------------------------------------------
    def create_job(self, job_id: str, document: dict[str, Any] | RawDocument, things: list[str]) -> None:
        with self._lock:
            for thing in things:
                before = self._next(thing)
                self._executions.setdefault(thing, []).append(Execution(job_id, thing, document, time.time()))
                if self._next(thing) is not before:
                    self._notify_next(thing)

    def cancel(self, thing: str, job_id: str) -> None:
        with self._lock:
            execution = self.execution(thing, job_id)
            execution.status, execution.version = "CANCELED", execution.version + 1
            self._notify_next(thing)

    def execution(self, thing: str, job_id: str) -> Execution:
        with self._lock:
            return next(e for e in self._executions.get(thing, []) if e.job_id == job_id)

    def wait_status(self, thing: str, job_id: str, statuses: set[str], timeout: float = 90.0) -> Execution:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            execution = self.execution(thing, job_id)
            if execution.status in statuses:
                return execution
            time.sleep(0.05)
        execution = self.execution(thing, job_id)
        raise AssertionError(f"{job_id} is {execution.status}, not {statuses} after {timeout}s: {execution}")

    # -- the device's side ------------------------------------------------------------------------
    def _next(self, thing: str) -> Execution | None:
        pending = [e for e in self._executions.get(thing, []) if e.status in ("QUEUED", "IN_PROGRESS")]
        in_progress = [e for e in pending if e.status == "IN_PROGRESS"]
        first = in_progress or pending
        return first[0] if first else None

    def _send(self, topic: str, body: dict[str, Any]) -> None:
        raw: dict[str, str] = {}

        def splice(value: Any) -> str:
            if not isinstance(value, RawDocument):
                raise TypeError(type(value).__name__)
            mark = f"@raw-document-{len(raw)}-{uuid.uuid4().hex}"
            raw[mark] = value.text
            return mark

        text = json.dumps({**body, "timestamp": int(time.time())}, default=splice)
        for mark, document in raw.items():
            text = text.replace(json.dumps(mark), document)
        self.client.publish(topic, text, qos=1)

    def _notify_next(self, thing: str) -> None:
        nxt = self._next(thing)
        body = {"execution": nxt.public()} if nxt is not None else {}
        self._send(f"$aws/things/{thing}/jobs/notify-next", body)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        parts = message.topic.split("/")
        if len(parts) < 5 or parts[-1] in ("accepted", "rejected", "notify-next"):
            return  # our own answers
        thing, rest = parts[2], "/".join(parts[4:])
        try:
            body = json.loads(message.payload or b"{}")
        except ValueError:
            body = None
        base = f"$aws/things/{thing}/jobs"
        token = {"clientToken": body.get("clientToken")} if isinstance(body, dict) else {}
        if not isinstance(body, dict):
            self._send(f"{base}/{rest}/rejected", {"code": "InvalidRequest", "message": "not a JSON object"})
            return
        with self._lock:
            if rest == "start-next":
                self._start_next(thing, body, base, token)
            elif rest == "$next/get":
                nxt = self._next(thing)
                self.queries.append(("$next", nxt.status if nxt else ""))
                self._send(
                    f"{base}/$next/get/accepted", {**token, **({"execution": nxt.public()} if nxt else {})}
                )
            elif rest.endswith("/get"):
                self._get(thing, rest[: -len("/get")], base, token)
            elif rest.endswith("/update"):
                self._update(thing, rest[: -len("/update")], body, base, token)

    def _start_next(self, thing: str, body: dict[str, Any], base: str, token: dict[str, Any]) -> None:
        nxt = self._next(thing)
        if nxt is not None and nxt.status == "QUEUED":
            nxt.status, nxt.version = "IN_PROGRESS", nxt.version + 1
            nxt.status_details = dict(body.get("statusDetails") or {})
            self._step(nxt, body.get("stepTimeoutInMinutes"))
        self._send(f"{base}/start-next/accepted", {**token, **({"execution": nxt.public()} if nxt else {})})

    def _get(self, thing: str, job_id: str, base: str, token: dict[str, Any]) -> None:
        try:
            execution = self.execution(thing, job_id)
            self.queries.append((job_id, execution.status))
        except StopIteration:
            self.queries.append((job_id, ""))
            self._send(f"{base}/{job_id}/get/rejected", {**token, "code": "ResourceNotFound",
                                                         "message": f"no job {job_id}"})  # fmt: skip
            return
        self._send(f"{base}/{job_id}/get/accepted", {**token, "execution": execution.public()})

    def _update(
        self, thing: str, job_id: str, body: dict[str, Any], base: str, token: dict[str, Any]
    ) -> None:
        try:
            execution = self.execution(thing, job_id)
        except StopIteration:
            self._reject(base, job_id, token, "ResourceNotFound", f"no job {job_id}", None)
            return
        execution.updates.append(body)
        state = {"status": execution.status, "statusDetails": execution.status_details,
                 "versionNumber": execution.version}  # fmt: skip
        details = body.get("statusDetails", {})
        if execution.status in TERMINAL:
            execution.refused_updates.append(body)
            return self._reject(base, job_id, token, "InvalidStateTransition",
                                f"the execution is {execution.status}", execution, state)  # fmt: skip
        if "expectedVersion" in body and body["expectedVersion"] != execution.version:
            wrong = f"expected {body['expectedVersion']}, is {execution.version}"
            return self._reject(base, job_id, token, "VersionMismatch", wrong, execution, state)
        if body.get("status") not in DEVICE_STATUSES:
            return self._reject(
                base, job_id, token, "InvalidRequest", f"status {body.get('status')}", execution
            )
        if not isinstance(details, dict) or not all(isinstance(v, str) for v in details.values()):
            return self._reject(base, job_id, token, "InvalidRequest", "statusDetails values must be strings",
                                execution)  # fmt: skip
        execution.status, execution.version = body["status"], execution.version + 1
        execution.status_details.update(details)
        self._step(execution, body.get("stepTimeoutInMinutes"))
        answer: dict[str, Any] = {**token}
        if body.get("includeJobExecutionState"):
            answer["executionState"] = {"status": execution.status, "statusDetails": execution.status_details,
                                        "versionNumber": execution.version}  # fmt: skip
        self._send(f"{base}/{job_id}/update/accepted", answer)
        if execution.status in TERMINAL:
            execution.deadline = None
            self._notify_next(thing)

    def _reject(self, base: str, job_id: str, token: dict[str, Any], code: str, message: str,
                execution: Execution | None, state: dict[str, Any] | None = None) -> None:  # fmt: skip
        if execution is not None:
            execution.rejections.append(code)
        body = {**token, "code": code, "message": message, **({"executionState": state} if state else {})}
        self._send(f"{base}/{job_id}/update/rejected", body)

    def _step(self, execution: Execution, minutes: Any) -> None:
        if isinstance(minutes, int) and minutes > 0:
            execution.deadline = time.monotonic() + minutes * self.minute_s

    def _timers(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                for thing, executions in self._executions.items():
                    for execution in executions:
                        if (
                            execution.status == "IN_PROGRESS"
                            and execution.deadline
                            and now > execution.deadline
                        ):
                            execution.status, execution.version = "TIMED_OUT", execution.version + 1
                            execution.deadline = None
                            self._notify_next(thing)
