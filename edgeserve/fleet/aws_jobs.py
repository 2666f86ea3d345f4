"""AWS IoT Jobs, the device side of its documented MQTT contract (`[fleet] protocol = "aws-iot-jobs"`),
and the edgeserve job document. No MQTT here: topics, the document, the mapping of the agent's outcomes
onto job execution statuses.

Topics (thing = `[fleet] device_id`), all under `$aws/things/{thing}/jobs/`:

    notify-next                      <- the next pending execution changed (or there is none)
    $next/get          (+/accepted, /rejected)   what is next, without starting it
    start-next         (+/accepted, /rejected)   start the next pending execution (QUEUED -> IN_PROGRESS)
    {jobId}/get        (+/accepted, /rejected)   one execution's status (is it still ours?)
    {jobId}/update     (+/accepted, /rejected)   status, statusDetails, expectedVersion, stepTimeoutInMinutes

The job document (JSON, at most 32 KB on AWS) carries, per thing, a command signed in the very envelope
MQTT commands use (OTA.md "Signed commands"), signed for that device's own command topic
`es/v1/{fleet}/{thing}/cmd/{verb}`: a document cannot be retargeted to another device or verb.

    {"edgeserve": {"verb": "deploy_bundle", "step_timeout_min": 30,
                   "commands": {"cam-1": {"v": 1, "key_id": "...", "sig": "...", "command": "{...}"}}}}
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from edgeserve.fleet.gate import UNSIGNED, check_self_revocation
from edgeserve.fleet.jsonlimits import JsonRefused, check_shape, loads
from edgeserve.fleet.protocol import MAX_PAYLOAD_BYTES, VERBS, Command, CommandError, Topics, parse_command
from edgeserve.fleet.signed import CommandKeys, check_lifetime, is_envelope, open_command
from edgeserve.logs import safe

log = logging.getLogger("edgeserve.fleet")

PROTOCOL = "aws-iot-jobs"
QUEUED, IN_PROGRESS, SUCCEEDED, FAILED = "QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED"
REJECTED, TIMED_OUT, CANCELED, REMOVED = "REJECTED", "TIMED_OUT", "CANCELED", "REMOVED"
TERMINAL = frozenset({SUCCEEDED, FAILED, REJECTED, TIMED_OUT, CANCELED, REMOVED})
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # AWS's own rule for job ids: safe as a topic level
THING_RE = re.compile(r"^[A-Za-z0-9:_-]{1,128}$")  # AWS's rule for thing names (as config.py checks it)
MAX_DOCUMENT_BYTES = 32 * 1024  # AWS IoT's limit for a job document; the device holds a document to it too
DOCUMENT_DEPTH = 8  # an edgeserve document nests 4 deep ({edgeserve: {commands: {thing: envelope}}})
DOCUMENT_KEYS = 1024  # object keys in all: a 32 KB document has room for some 150 things' commands
MESSAGE_DEPTH = 24  # a Jobs message around its document: values nested deeper are cut before parsing
DEFAULT_STEP_TIMEOUT_MIN = 60  # each step (download, verify, load, trial) must report within this
MAX_STEP_TIMEOUT_MIN = 10080  # AWS's limit (7 days)
MAX_DETAIL_CHARS = 1000  # AWS caps a statusDetails value at 1024 characters
ANSWER_WAIT_S = 15.0  # an update unanswered this long: carry on (a final one is sent again at connect)


@dataclass(frozen=True)
class JobTopics:
    thing: str

    @property
    def base(self) -> str:
        return f"$aws/things/{self.thing}/jobs"

    @property
    def notify_next(self) -> str:
        return f"{self.base}/notify-next"

    @property
    def next_get(self) -> str:
        return f"{self.base}/$next/get"

    @property
    def start_next(self) -> str:
        return f"{self.base}/start-next"

    def get(self, job_id: str) -> str:
        return f"{self.base}/{job_id}/get"

    def update(self, job_id: str) -> str:
        return f"{self.base}/{job_id}/update"

    def subscriptions(self) -> list[str]:
        """Every answer the device listens for (a `$` topic is never matched by a leading wildcard)."""
        answers = [f"{self.base}/{leaf}/{kind}" for leaf in ("$next/get", "start-next", "+/get", "+/update")
                   for kind in ("accepted", "rejected")]  # fmt: skip
        return [self.notify_next, *answers]

    def parse(self, topic: str) -> tuple[str, str] | None:
        """(job id or "$next" or "start-next" or "notify-next", the rest) of one of our topics."""
        if not topic.startswith(self.base + "/"):
            return None
        rest = topic[len(self.base) + 1 :]
        if rest == "notify-next":
            return "notify-next", ""
        head, _, tail = rest.partition("/")
        return head, tail


@dataclass(frozen=True)
class JobCommand:
    command: Command
    key_id: str | None  # None: an unsigned command let in by the lab opt-out
    step_timeout_min: int


def job_id_of(execution: dict[str, Any]) -> str:
    job_id = execution.get("jobId")
    if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
        raise CommandError(f"job id {safe(job_id, 80)} is not 1-64 letters, digits, '_', '-'")
    return job_id


def check_thing(thing: str) -> str:
    """A thing name as AWS IoT allows it (it is also the device id: one topic level, never a '.')."""
    if not THING_RE.match(thing):
        raise ValueError(
            f"thing name {safe(thing, 140)} is not 1-128 letters, digits, ':', '_', '-' (AWS IoT's rule, "
            "no '.')"
        )
    return thing


def bounded_document(document: Any) -> Any:
    """The job document (an object, or its JSON text) within limits; CommandError says which it is over."""
    try:
        if isinstance(document, str):
            return loads(document, max_bytes=MAX_DOCUMENT_BYTES, max_depth=DOCUMENT_DEPTH,
                         max_keys=DOCUMENT_KEYS)  # fmt: skip
        check_shape(document, max_depth=DOCUMENT_DEPTH, max_keys=DOCUMENT_KEYS)
    except JsonRefused as exc:
        raise CommandError(f"the job document is refused: {exc}") from None
    size = len(json.dumps(document, separators=(",", ":")).encode())
    if size > MAX_DOCUMENT_BYTES:
        raise CommandError(f"the job document is refused: {size} bytes, over {MAX_DOCUMENT_BYTES}")
    return document


def open_job(
    document: Any,
    *,
    thing: str,
    fleet: str,
    keys: CommandKeys,
    require_signed: bool,
    now: datetime,
    max_lifetime_s: float,
) -> JobCommand:
    """The verified command a job document carries for this thing; CommandError says why not (REJECTED)."""
    document = bounded_document(document)
    section = document.get("edgeserve") if isinstance(document, dict) else None
    if not isinstance(section, dict):
        raise CommandError("the job document has no 'edgeserve' object: not an edgeserve job")
    verb = section.get("verb")
    if verb not in VERBS:
        raise CommandError(f"job verb {safe(verb, 40)} is not one of {', '.join(VERBS)}")
    step = section.get("step_timeout_min", DEFAULT_STEP_TIMEOUT_MIN)
    if not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= MAX_STEP_TIMEOUT_MIN:
        raise CommandError(f"step_timeout_min must be 1 to {MAX_STEP_TIMEOUT_MIN} minutes")
    commands = section.get("commands")
    if not isinstance(commands, dict):
        raise CommandError("the job document has no 'commands' object ({thing name: signed command})")
    entry = commands.get(thing)
    if entry is None:
        raise CommandError(f"the job document has no command for thing {thing} ({len(commands)} other(s))")
    payload = (entry if isinstance(entry, str) else json.dumps(entry)).encode("utf-8")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise CommandError(f"the command is {len(payload)} bytes, over {MAX_PAYLOAD_BYTES}")
    topic = Topics(fleet, thing).cmd(str(verb))  # what the sender signed for: this device, this verb
    body = entry if isinstance(entry, dict) else None
    if is_envelope(body):
        command = open_command(topic, payload, keys.current(), now, max_lifetime_s)
        key: str | None = str(body.get("key_id")) if body else None
        raw = loads(str(body.get("command")), max_bytes=MAX_PAYLOAD_BYTES) if body else {}
    elif require_signed:
        raise CommandError(UNSIGNED.format(what="job command"))
    else:
        command = parse_command(str(verb), payload, now)
        check_lifetime(command, now, max_lifetime_s)
        key, raw = None, loads(payload, max_bytes=MAX_PAYLOAD_BYTES)
    check_self_revocation(command, key)  # as on the es/v1 surface: a key revokes only itself
    named = raw.get("device") if isinstance(raw, dict) else None
    if named not in (None, thing):
        raise CommandError(f"command for device {safe(named, 64)}, this is {thing}")
    return JobCommand(command, key, step)


def details(**fields: Any) -> dict[str, str]:
    """statusDetails: AWS takes string values only; None is left out, text is escaped and capped."""
    out: dict[str, str] = {}
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, float):
            text = f"{value:.3f}".rstrip("0").rstrip(".")
        elif isinstance(value, (dict, list)):
            text = json.dumps(value, separators=(",", ":"), default=str)
        else:
            text = str(value)
        if not text.isprintable():  # no raw control characters in what the AWS console shows
            text = repr(text)[1:-1]
        out[key] = text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."
    return out


def execution_of(body: Any) -> dict[str, Any] | None:
    """The `execution` object of a notify-next / start-next / get answer, if it names one."""
    execution = body.get("execution") if isinstance(body, dict) else None
    return execution if isinstance(execution, dict) and execution.get("jobId") else None


@dataclass
class Execution:
    """One job execution the device runs, as it knows it."""

    job_id: str
    key: str  # job:{jobId}:{executionNumber}, the ledger's name for it
    version: int  # versionNumber as last seen: the expectedVersion of the next update
    step_min: int = DEFAULT_STEP_TIMEOUT_MIN
    cancel: threading.Event = field(default_factory=threading.Event)
    gone: str = ""  # the service ended it (TIMED_OUT, CANCELED, ...): stop, undo
    state: str = ""  # the install state last reported
    reported_at: float = 0.0
    command: Command | None = None
    accepted: bool = False  # its command was accepted (in the ledger until it expires), not refused
    finished: bool = False  # its final status is decided: nothing more is asked or said about it


@dataclass
class _Answer:
    done: threading.Event = field(default_factory=threading.Event)
    accepted: bool = False
    body: dict[str, Any] = field(default_factory=dict)


class Updates:
    """UpdateJobExecution as a call: publish with a clientToken, wait for .../accepted or .../rejected."""

    def __init__(self, topics: JobTopics, publish: Callable[[str, dict[str, Any]], object],
                 connected: threading.Event, stopping: threading.Event) -> None:  # fmt: skip
        self.topics = topics
        self.publish = publish
        self.connected = connected
        self.stopping = stopping
        self._waiting: dict[str, _Answer] = {}

    def answered(self, tail: str, body: dict[str, Any]) -> None:
        """An answer arrived (network thread): wake whoever waits for its clientToken."""
        token = body.get("clientToken")
        waiter = self._waiting.pop(token, None) if isinstance(token, str) else None
        if waiter is not None:
            waiter.accepted, waiter.body = tail.endswith("accepted"), body
            waiter.done.set()

    def update(self, run: Execution, status: str, status_details: dict[str, str], *,
               step: bool = False) -> bool | None:  # fmt: skip
        """True accepted, False rejected, None no answer in time. A VersionMismatch is retried once with
        the version the service holds; a new step restarts the step timer. Nothing is sent for an execution
        the service ended (cancelled, timed out): AWS refuses it, and each refusal is a billed message."""
        for _ in range(2):
            if run.gone:
                return False
            body: dict[str, Any] = {"status": status, "statusDetails": status_details}
            body.update(expectedVersion=run.version, includeJobExecutionState=True)
            if step and status == IN_PROGRESS:
                body["stepTimeoutInMinutes"] = run.step_min
            answer = self._ask(self.topics.update(run.job_id), body)
            if answer is None:
                return None
            state = answer.body.get("executionState")
            if isinstance(state, dict) and isinstance(state.get("versionNumber"), int):
                run.version = int(state["versionNumber"])
            elif answer.accepted:
                run.version += 1
            if answer.accepted:
                return True
            if answer.body.get("code") != "VersionMismatch":
                code, text = safe(answer.body.get("code"), 40), safe(answer.body.get("message"), 200)
                log.warning("job %s: update to %s rejected: %s %s", run.job_id, status, code, text)
                return False
        return False

    def _ask(self, topic: str, body: dict[str, Any]) -> _Answer | None:
        if not self.connected.is_set():
            return None
        token = new_token()
        waiter = _Answer()
        self._waiting[token] = waiter
        self.publish(topic, {**body, "clientToken": token})
        deadline = time.monotonic() + ANSWER_WAIT_S
        while not waiter.done.wait(0.2):
            if time.monotonic() > deadline or self.stopping.is_set():
                self._waiting.pop(token, None)
                return None
        return waiter


def new_token() -> str:
    return uuid.uuid4().hex[:16]
