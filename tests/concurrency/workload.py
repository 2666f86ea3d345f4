"""Generators and checkers of the concurrency suite, shared by tests/concurrency/ (the short round)
and benchmarks/concurrency_soak.py (the long round).

A seed fixes every client's plan: which models, batch rows, sequence lengths and values, think times,
pipelining, HTTP binary or JSON, repeats for the cache. Client `i` talks over TRANSPORTS[i % 8] on
its own connection, in its own thread. Every answer is checked on the client side against the
reference of conc_models.py; a failure names the seed, client, transport, request id, model, what
was expected and what came, and where a wrong answer decodes to another request, whose it was.

    report = run_clients(endpoints, seed=7, clients=16, mix=Mix(stateless=STATESLESS), ops_per_client=10)
    assert report.ok, report.render(replay="EDGESERVE_CONC_SEEDS=7 pytest tests/concurrency")
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from conc_models import ID_BASE, NARROW_UINT64_BASE, VERSION_STEP, AffineModel, Array, Repository, SeqModel
from conc_transports import DEADLINE_WIRES, Answer, Call, Endpoints, Transport
from conc_wires import CONCURRENT, ORDERED, TRANSPORTS, connect

MAX_KEPT = 40  # mismatches kept in full per report (all are counted)
HOT_ROWS = 8  # rows every client may send (cross-client cache hits)


@dataclass(frozen=True)
class Mix:
    """What the clients send, and how."""

    stateless: tuple[AffineModel, ...] = ()
    sequences: tuple[SeqModel, ...] = ()
    p_sequence: float = 0.5
    max_rows: int = 4
    max_burst: int = 4
    max_steps: int = 8
    max_think_ms: float = 3.0
    p_repeat: float = 0.25  # resend an earlier X (cache hits, where the cache is on)
    p_reuse_id: float = 0.2  # start the last finished sequence's ID again (its state must restart)
    p_pipelined: float = 0.6  # where the wire allows: all calls of an op in flight at once
    p_json: float = 0.3  # HTTP: JSON tensors instead of binary ones
    p_versioned: float = 0.0  # reloadable models: name the version that was serving when the op began
    p_deadline: float = 0.0  # stateless calls on DEADLINE_WIRES: a 1-10 ms client deadline
    transports: tuple[str, ...] = TRANSPORTS


@dataclass
class Expect:
    """What a call must get back."""

    model: AffineModel | SeqModel
    x: Array | None = None  # stateless: the rows sent
    step: int = 0  # sequence: this call's step, of `length`
    length: int = 0
    total: float = 0.0  # sequence: the running sum after this step
    sequence_id: int | str = 0
    may_give_up: bool = False  # a short client deadline: DEADLINE_EXCEEDED is an answer too


@dataclass
class Op:
    client: int
    number: int
    transport: str
    think_s: float
    pipelined: bool
    calls: list[Call]
    expects: list[Expect]
    versioned: bool = False


@dataclass(frozen=True)
class Mismatch:
    kind: str
    seed: int
    client: int
    transport: str
    request_id: str
    where: str
    expected: str
    got: str

    def __str__(self) -> str:
        return (
            f"[{self.kind}] seed {self.seed} client {self.client} ({self.transport}) request "
            f"{self.request_id} {self.where}: expected {self.expected}; got {self.got}"
        )


# -- plans ---------------------------------------------------------------------------------------------
def identity_row(client: int, counter: int, row: int, salt: int) -> list[float]:
    # Every column stays below 2**20: X * 3 + c, and the ensemble's ((X + 10) * 3 + c) * 2, stay exact.
    return [float(client % 4096), float(counter % 2**20), float(row), float(salt)]


def hot_rows(seed: int) -> Array:
    rng = np.random.default_rng([seed, 999_999])
    return np.array([identity_row(4095, h, 0, int(rng.integers(2**20))) for h in range(HOT_ROWS)], np.float32)


def client_ops(seed: int, run: int, client: int, mix: Mix) -> Iterator[Op]:
    """Client `client`'s endless plan (take as many ops as the round wants)."""
    rng = np.random.default_rng([seed, run, client])
    transport = mix.transports[client % len(mix.transports)]
    sent: list[Array] = []
    hot = hot_rows(seed)
    counter = itertools.count()
    last_ids: dict[str, int | str] = {}
    numbers: dict[str, int] = collections.Counter()
    for number in itertools.count():
        think = float(rng.uniform(0, mix.max_think_ms)) / 1000
        pipelined = bool(rng.random() < mix.p_pipelined)
        binary = bool(rng.random() >= mix.p_json)
        use_sequence = mix.sequences and (not mix.stateless or rng.random() < mix.p_sequence)
        calls: list[Call] = []
        expects: list[Expect] = []
        versioned = False
        if use_sequence:
            seq = mix.sequences[int(rng.integers(len(mix.sequences)))]
            if seq.name in last_ids and rng.random() < mix.p_reuse_id:
                sequence_id = last_ids[seq.name]
            else:
                numbers[seq.name] += 1
                sequence_id = seq.sequence_id(
                    seed, run, client, numbers[seq.name], not transport.startswith("grpc")
                )
            last_ids[seq.name] = sequence_id
            length = int(rng.integers(1, mix.max_steps + 1))
            total = 0.0
            for step in range(length):
                value = float(rng.integers(1, 1000))
                total += value
                calls.append(
                    Call(
                        seq.name,
                        {"INPUT": np.full(seq.input_shape(), value, np.float32)},
                        seq.outputs,
                        f"c{client}-o{number}-s{step}",
                        sequence_id=sequence_id,
                        start=step == 0,
                        end=step == length - 1,
                        binary=binary,
                    )
                )
                expects.append(Expect(seq, step=step, length=length, total=total, sequence_id=sequence_id))
        else:
            reloadable = [m for m in mix.stateless if m.reloadable]
            versioned = bool(reloadable) and bool(rng.random() < mix.p_versioned)
            models = reloadable if versioned else mix.stateless
            for i in range(int(rng.integers(1, mix.max_burst + 1))):
                model = models[int(rng.integers(len(models)))]
                pick = rng.random()
                if pick < mix.p_repeat / 2 and sent:
                    x = sent[int(rng.integers(len(sent)))]
                elif pick < mix.p_repeat:
                    x = hot[int(rng.integers(HOT_ROWS))][None, :]
                else:
                    rows = int(rng.integers(1, mix.max_rows + 1))
                    n = next(counter)
                    x = np.array(
                        [identity_row(client, n, r, int(rng.integers(2**20))) for r in range(rows)],
                        np.float32,
                    )
                    sent.append(x)
                    del sent[:-32]
                short = transport in DEADLINE_WIRES and bool(rng.random() < mix.p_deadline)
                timeout = float(rng.uniform(0.001, 0.01)) if short else None
                rid = f"c{client}-o{number}-{i}"
                calls.append(Call(model.name, {"X": x}, model.outputs, rid, binary=binary, timeout_s=timeout))
                expects.append(Expect(model, x=x, may_give_up=short))
        pipelined = pipelined and transport in (ORDERED if use_sequence else CONCURRENT)
        yield Op(client, number, transport, think, pipelined, calls, expects, versioned)


# -- checking ------------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    array = np.asarray(value)
    return np.array2string(array, separator=",", threshold=16) if array.size > 1 else repr(array.item())


def whose(model: AffineModel, y: Array) -> str:
    """Who a wrong stateless answer belongs to, decoded from its identity rows."""
    x = np.rint(model.decode(np.asarray(y, np.float64)))
    if x.ndim != 2 or x.shape[1] != 4:
        return ""
    rows = [f"client {int(r[0])} request counter {int(r[1])} row {int(r[2])}" for r in x[:2]]
    return "; decodes to " + " / ".join(rows) + (" ..." if len(x) > 2 else "")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _echoed_corrid(seq: SeqModel, outputs: dict[str, Array]) -> int | bytes | None:
    if not seq.corrid:
        return None
    value = outputs["ECHO_CORRID"].reshape(-1)[0]
    if seq.corrid == "string":
        return value.encode() if isinstance(value, str) else bytes(value)
    return int(value)


def _sequence_owner(seq: SeqModel, corrid: int | bytes | None) -> str:
    """Whose sequence an echoed CORRID is (the ID layout of SeqModel.sequence_id)."""
    if corrid is None or isinstance(corrid, bytes):
        return ""
    offset = corrid - ID_BASE[seq.corrid]
    if offset < 0 and seq.corrid == "uint64":
        offset = corrid - NARROW_UINT64_BASE
    if offset < 0:
        return ""
    return f" (run {offset // 2**24}, client {offset % 2**24 // 2**17}, sequence number {offset % 2**17})"


def _retired(error: str, named: int | None, window: tuple[int, int] | None) -> bool:
    """Whether `error` is the refusal of a named version that a newer one replaced meanwhile."""
    if named is None or window is None or named >= window[1]:
        return False
    return f"version {named}" in error and ("not at ready state" in error or "not available" in error)


class Checker:
    """Checks answers against the references; `window` gives the versions a versioned model may
    answer with (reload rounds)."""

    def __init__(self, seed: int, report: Report | None = None) -> None:
        self.seed = seed
        self.report = report

    def _note(self, what: str) -> None:
        """Count an accepted non-answer (a refusal or a deadline the client asked for)."""
        if self.report is not None:
            with self.report.lock:
                self.report.notes[what] += 1

    def check(
        self,
        op: Op,
        answers: Sequence[Answer],
        window: tuple[int, int] | None = None,
        named: int | None = None,
    ) -> list[Mismatch]:
        found: list[Mismatch] = []
        for call, expect, answer in zip(op.calls, op.expects, answers, strict=True):

            def bad(kind: str, expected: Any, got: Any, call: Call = call) -> None:
                found.append(
                    Mismatch(
                        kind,
                        self.seed,
                        op.client,
                        op.transport,
                        call.request_id,
                        call.describe(),
                        str(expected),
                        str(got),
                    )
                )

            if answer.error is not None:
                if not answer.lost and _retired(answer.error, named, window):
                    self._note("refused: named version replaced")  # a clear refusal is right
                    continue
                if expect.may_give_up and "DEADLINE_EXCEEDED" in answer.error:
                    self._note("gave up: client deadline")  # as asked; its late answer must go nowhere
                    continue
                bad("lost" if answer.lost else "error", "an answer", answer.error)
                continue
            if answer.response_id is not None and answer.response_id != call.request_id:
                bad("request_id", f"response id {call.request_id!r}", repr(answer.response_id))
            outputs = answer.outputs or {}
            missing = [n for n in call.outputs if n not in outputs]
            if missing:
                bad("missing_output", call.outputs, sorted(outputs))
                continue
            if isinstance(expect.model, SeqModel):
                self._sequence(expect.model, expect, outputs, bad)
            elif expect.model.reloadable:
                span = window or (1, 1)
                self._versioned(expect.model, expect, answer, outputs["Y"], span, named, bad)
            else:
                self._stateless(expect.model, expect, outputs["Y"], bad)
            # The model's request_id() of each row: the call's ID where the wire carries it, else the
            # ZeroMQ client's own ID of the request (the one its reply was matched by).
            own_id = call.request_id if answer.response_id is not None else answer.wire_id
            if "RID" in outputs and own_id is not None:
                rids = {_text(v) for v in np.asarray(outputs["RID"]).reshape(-1)}
                if rids != {own_id}:
                    bad("request_id", f"request_id() {own_id!r} in the model", sorted(rids))
        return found

    @staticmethod
    def _stateless(model: AffineModel, expect: Expect, y: Array, bad: Callable[..., None]) -> None:
        assert expect.x is not None
        want = model.expected(expect.x)
        if y.shape != want.shape:
            bad("shape", list(want.shape), list(y.shape))
        elif not np.array_equal(y, want):
            mine = (
                " (rows of this request came back in another order)"
                if np.array_equal(np.sort(y, axis=0), np.sort(want, axis=0))
                else ""
            )
            bad("value", _fmt(want), _fmt(y) + mine + whose(model, y))

    @staticmethod
    def _versioned(
        model: AffineModel,
        expect: Expect,
        answer: Answer,
        y: Array,
        window: tuple[int, int],
        named: int | None,
        bad: Callable[..., None],
    ) -> None:
        assert expect.x is not None
        if y.shape != expect.x.shape:
            bad("shape", list(expect.x.shape), list(y.shape))
            return
        offset = np.asarray(y, np.float64) - model.k * np.asarray(expect.x, np.float64)
        version = int(np.rint(offset.reshape(-1)[0] / VERSION_STEP))
        if not np.array_equal(y, model.with_version(version).expected(expect.x)):
            bad("value", f"X * {model.k} + {VERSION_STEP:g} * version", _fmt(y) + whose(model, y))
            return
        low, high = (named, named) if named is not None else window
        if not low <= version <= high:
            what = f"version {named} (named)" if named is not None else f"a version in {low}..{high}"
            bad("version", what + " (loaded when the request was sent/answered)", f"version {version}")
        if answer.model_version not in (None, "", str(version)):
            bad(
                "version_label",
                f"model_version {version!r} (the answer's values)",
                repr(answer.model_version),
            )

    @staticmethod
    def _sequence(seq: SeqModel, expect: Expect, outputs: dict[str, Array], bad: Callable[..., None]) -> None:
        shape = seq.input_shape()
        flags = {"START": expect.step == 0, "END": expect.step == expect.length - 1, "READY": True}
        for name, array in outputs.items():
            if tuple(np.shape(array)) != shape:
                bad("shape", f"{name} {list(shape)}", list(np.shape(array)))
                return
        got_corrid = _echoed_corrid(seq, outputs)
        owner = _sequence_owner(seq, got_corrid)
        total = float(outputs["OUTPUT"].reshape(-1)[0])
        if total != expect.total:
            bad(
                "value",
                f"running sum {expect.total:g} after step {expect.step + 1} of {expect.length}",
                f"{total:g}" + (f"; CORRID {got_corrid!r}{owner}" if seq.corrid else ""),
            )
        for flag in seq.flags:
            got = float(outputs[f"ECHO_{flag.kind}"].reshape(-1)[0])
            want = flag.value(flags[flag.kind])
            if flag.dtype == "bool":
                want = float(bool(want))
            if got != want:
                bad(
                    "control",
                    f"{flag.kind} ({flag.dtype}) = {want:g} at step {expect.step + 1} of {expect.length}",
                    f"{got:g}",
                )
        want_corrid = seq.corrid_value(expect.sequence_id)
        if seq.corrid and got_corrid != want_corrid:
            bad("corrid", f"CORRID ({seq.corrid}) {want_corrid!r}", f"{got_corrid!r}{owner}")
        if "REQ_FLAGS" in outputs:
            want_flags = (1 if expect.step == 0 else 0) | (2 if expect.step == expect.length - 1 else 0)
            got_flags = int(outputs["REQ_FLAGS"].reshape(-1)[0])
            if got_flags != want_flags:
                bad("control", f"request flags() {want_flags} (1 = START, 2 = END)", got_flags)
            got_id = _text(outputs["REQ_CORRID"].reshape(-1)[0])
            if got_id != str(expect.sequence_id):
                bad("corrid", f"request correlation_id() {str(expect.sequence_id)!r}", repr(got_id))
        if "ROWS" in outputs and int(outputs["ROWS"].reshape(-1)[0]) != 1:
            bad(
                "rows",
                "one row per Python request (Triton gives execute() one request per sequence step)",
                f"{int(outputs['ROWS'].reshape(-1)[0])} rows in the request",
            )


# -- running -------------------------------------------------------------------------------------------
@dataclass(repr=False)
class Report:
    seed: int
    clients: int = 0
    ops: int = 0
    requests: int = 0
    by_transport: collections.Counter[str] = field(default_factory=collections.Counter)
    by_kind: collections.Counter[str] = field(default_factory=collections.Counter)
    by_model: collections.Counter[str] = field(default_factory=collections.Counter)
    notes: collections.Counter[str] = field(default_factory=collections.Counter)  # accepted non-answers
    mismatches: list[Mismatch] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def ok(self) -> bool:
        return not self.by_kind

    def add(self, op: Op, found: list[Mismatch]) -> None:
        with self.lock:
            self.ops += 1
            self.requests += len(op.calls)
            self.by_transport[op.transport] += len(op.calls)
        self.flag(*found)

    def flag(self, *found: Mismatch) -> None:
        with self.lock:
            for mismatch in found:
                self.by_kind[mismatch.kind] += 1
                self.by_model[mismatch.where.split(" ")[0]] += 1
                if len(self.mismatches) < MAX_KEPT:
                    self.mismatches.append(mismatch)

    def crash(self, client: int, transport: str, text: str) -> None:
        self.flag(
            Mismatch("client_crash", self.seed, client, transport, "-", "(client)", "no exception", text)
        )

    def __repr__(self) -> str:
        return f"Report({self.summary()})"

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.by_kind.items())) or "none"
        if self.by_model:
            kinds += " (by model: " + ", ".join(f"{k} {n}" for k, n in sorted(self.by_model.items())) + ")"
        wires = ", ".join(f"{k} {n}" for k, n in sorted(self.by_transport.items()))
        notes = "".join(f"; {k}: {n}" for k, n in sorted(self.notes.items()))
        return (
            f"seed {self.seed}: {self.clients} clients, {self.ops} ops, {self.requests} requests "
            f"({wires}){notes}; mismatches: {kinds}"
        )

    def render(self, replay: str = "") -> str:
        lines = [self.summary()]
        lines += [f"  {m}" for m in self.mismatches]
        hidden = sum(self.by_kind.values()) - len(self.mismatches)
        if hidden > 0:
            lines.append(f"  ... and {hidden} more")
        if replay:
            lines.append(f"replay: {replay}")
        return "\n".join(lines)


class VersionWindow:
    """Versions a reloadable model may answer with: from the newest whose load returned before the
    request was sent, to the newest whose load had begun when its answer came."""

    def __init__(self, first: int = 1) -> None:
        self.loaded = first
        self.started = first
        self.lock = threading.Lock()

    def begin(self, version: int) -> None:
        with self.lock:
            self.started = max(self.started, version)

    def done(self, version: int) -> None:
        with self.lock:
            self.loaded = max(self.loaded, version)


@dataclass
class Progress:
    """Finished ops, for whoever waits on the traffic (the reload controller, the soak's printer)."""

    done: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)

    def tick(self) -> None:
        with self.cond:
            self.done += 1
            self.cond.notify_all()

    def wait_for(self, count: int, stop: threading.Event, timeout: float = 300.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.done < count and not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.2))
            return self.done >= count


def _end_broken_sequence(transport: Transport, op: Op, answers: Sequence[Answer]) -> None:
    """A sequence whose last step got no answer may still hold its slot on the server: send END, as a
    client would, so it does not hold the slot until the idle timeout (its answer is not checked)."""
    last = op.calls[-1] if op.calls else None
    if last is None or not last.sequence_id or answers[-1].error is None:
        return
    transport.run(
        [
            dataclasses.replace(
                last, request_id=last.request_id + "-end", start=False, end=True, timeout_s=None
            )
        ],
        False,
    )


def run_one_client(
    endpoints: Endpoints,
    seed: int,
    run: int,
    client: int,
    mix: Mix,
    report: Report,
    checker: Checker,
    ops_per_client: int | None,
    stop: threading.Event,
    window: VersionWindow | None = None,
    progress: Progress | None = None,
) -> None:
    transport_name = mix.transports[client % len(mix.transports)]
    transport: Transport | None = None
    try:
        transport = connect(transport_name, endpoints)
        plan = client_ops(seed, run, client, mix)
        for op in itertools.islice(plan, ops_per_client):
            if stop.is_set():
                break
            time.sleep(op.think_s)
            floor = window.loaded if window is not None else 1
            named = floor if op.versioned else None
            if named is not None:
                for call in op.calls:
                    call.version = str(named)
            answers = transport.run(op.calls, op.pipelined)
            span = (floor, window.started) if window is not None else None
            report.add(op, checker.check(op, answers, span, named))
            if progress is not None:
                progress.tick()
            _end_broken_sequence(transport, op, answers)
        leak = transport.leaks()
        if leak is not None:
            report.flag(Mismatch("leak", seed, client, transport_name, "-", "(client)", "nothing held", leak))
    except Exception:
        report.crash(client, transport_name, traceback.format_exc())
    finally:
        if transport is not None:
            try:
                transport.close()
            except Exception:
                report.crash(client, transport_name, "close: " + traceback.format_exc())


def run_clients(
    endpoints: Endpoints,
    seed: int,
    clients: int,
    mix: Mix,
    *,
    run: int = 0,
    ops_per_client: int | None = None,
    stop: threading.Event | None = None,
    window: VersionWindow | None = None,
    progress: Progress | None = None,
    report: Report | None = None,
    join_timeout_s: float = 600.0,
) -> Report:
    """`clients` concurrent clients, each running its plan for `ops_per_client` ops (None: until
    `stop` is set). Returns the report once every client has finished."""
    if ops_per_client is None and stop is None:
        raise ValueError("an endless round needs a stop event")
    stop = stop or threading.Event()
    report = report or Report(seed)
    report.clients = clients
    checker = Checker(seed, report)
    threads = [
        threading.Thread(
            target=run_one_client,
            name=f"conc-client-{i}",
            daemon=True,
            args=(endpoints, seed, run, i, mix, report, checker, ops_per_client, stop, window, progress),
        )
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + join_timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        stop.set()
        report.crash(-1, "-", f"clients still running after {join_timeout_s:g} s: {', '.join(stuck)}")
    return report


def reload_rounds(
    endpoints: Endpoints,
    repo: Repository,
    window: VersionWindow,
    progress: Progress,
    stop: threading.Event,
    loads: int | None,
    every_ops: int,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """While the clients run: every `every_ops` finished ops, write the next version of every
    reloadable model and load it over the repository API (HTTP), `loads` times (None: until `stop`);
    then let `every_ops` more ops finish and set `stop`. Returns the problems (failed loads)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(endpoints.http_url, network_timeout=300.0)
    problems: list[str] = []
    try:
        for _ in itertools.count() if loads is None else range(loads):
            if not progress.wait_for(progress.done + every_ops, stop):
                if not stop.is_set():
                    problems.append(f"the traffic did not finish {every_ops} ops before a load")
                break
            version = max(repo.versions.values()) + 1
            window.begin(version)
            for model in repo.reloadable:
                repo.add_version(model.name)
                began = time.monotonic()
                client.load_model(model.name)
                if log is not None:
                    log(f"loaded {model.name} version {version} in {time.monotonic() - began:.2f} s")
            window.done(version)
        if not stop.is_set() and not progress.wait_for(progress.done + every_ops, stop):
            problems.append(f"the traffic did not finish {every_ops} ops after the last load")
    except Exception as exc:
        problems.append(f"loading a new version failed: {type(exc).__name__}: {exc}")
    finally:
        stop.set()
        client.close()
    return problems
