"""The concurrency suite's API, shared by tests/concurrency/ (the short round) and
benchmarks/concurrency_soak.py (the long round): run seeded clients against a server and report.

A seed fixes every client's plan (conc_plans.py): which models, batch rows, sequence lengths and
values, think times, pipelining, HTTP binary or JSON, repeats for the cache, short deadlines. Client
`i` talks over TRANSPORTS[i % 8] (conc_wires.py) in its own thread. Every answer is checked on the
client side against the reference of its request (conc_check.py); a failure names the seed, client,
wire, request id, model, what was expected and what came, and whose answer it was where it decodes
to another request.

    report = run_clients(endpoints, seed=7, clients=16, mix=Mix(stateless=STATELESS), ops_per_client=10)
    assert report.ok, report.render(replay="EDGESERVE_CONC_SEEDS=7 pytest tests/concurrency")
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from conc_check import Checker, Mismatch
from conc_models import Repository
from conc_plans import Mix, Op, client_ops
from conc_transports import Answer, Endpoints, Transport
from conc_wires import connect

__all__ = [  # the suite's API in one place (the benchmark and the tests import it from here)
    "Checker", "Mismatch", "Mix", "Op", "Progress", "Report", "VersionWindow", "client_ops", "reload_rounds",
    "run_clients",
]  # fmt: skip

MAX_KEPT = 40  # mismatches kept in full per report (all are counted)


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
