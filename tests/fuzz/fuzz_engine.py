"""The fuzz engine: a real `edgeserve serve` on loopback, one sender per frontend, batches of generated
requests, and after every batch a liveness check plus a correct request that must answer correctly.

A finding is any answer to client garbage in the server-error class:
- HTTP: any 5xx (501 only where the endpoint is documented as unsupported: CUDA shm);
- gRPC: INTERNAL, UNKNOWN, DATA_LOSS or UNIMPLEMENTED on an implemented method;
- gRPC stream: the same codes in `triton_grpc_error` mode, an "internal error" message otherwise;
- ZeroMQ: an "INTERNAL" or "UNKNOWN" status;
and also a hang (no answer within the per-request timeout), a crash (the server process exits) or a
failed correct request after a batch.

The one exception (documented in the issue): a gRPC message that does not parse as protobuf gets
INTERNAL "Unable to parse request", which is what grpcio's own deserializer answers before any
edgeserve code runs; our zero-copy deserializer answers the same on purpose (Triton compatibility).
That INTERNAL is accepted only for bytes the generator itself marks as possibly unparseable.

`KNOWN` lists server errors tolerated while their fix is under way (counted apart, reported); it is
empty: every server error fails the run.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from es_server import RunningServer, start_server  # noqa: E402
from fuzz_gen_grpc import GrpcCase, StreamCase, grpc_stream_case, grpc_unary_case  # noqa: E402
from fuzz_gen_http import HttpCase, http_binary_case, http_json_case  # noqa: E402
from fuzz_gen_zmq import ZmqCase, ring_case, zmq_case  # noqa: E402
from fuzz_senders import GrpcSender, HttpSender, Ring, ZmqSender, grpc_correct, http_correct, zmq_correct  # noqa: E402
from onnx_models import write_model  # noqa: E402

FRONTENDS = ("http_json", "http_binary", "grpc_unary", "grpc_stream", "zmq", "shm_ring")
ORT = 'backend: "onnxruntime"\n'

# Server errors known and tolerated while a fix is under way, counted apart and reported, not failed.
# Empty: the shared-memory ones (a missing key, a NUL in a key, references past a region) are fixed.
KNOWN: list[tuple[str, re.Pattern[str]]] = []


def build_repository(repo: Path) -> None:
    """Small real ONNX models: FP32 two inputs, BYTES, FP16, INT64, BOOL, dynamic HxW conv, no batch."""
    write_model(repo, "add_sub", "add_sub", config=ORT + "max_batch_size: 8\n")
    for name, datatype in (
        ("id_bytes", "BYTES"),
        ("id_fp16", "FP16"),
        ("id_int64", "INT64"),
        ("id_bool", "BOOL"),
    ):
        write_model(repo, name, "identity", datatype=datatype, config=ORT + "max_batch_size: 8\n")
    write_model(repo, "conv", "conv", config=ORT + "max_batch_size: 4\n")
    write_model(repo, "id_nobatch", "identity", datatype="UINT8", shape=["A", "B"], config=ORT)
    # The correct requests after each batch go to models the fuzzer never sends to: a batch that
    # mixes a fuzz request with a correct one fails both (a finding for the scheduler, see README).
    write_model(repo, "check_add_sub", "add_sub", config=ORT + "max_batch_size: 8\n")
    write_model(repo, "check_bytes", "identity", datatype="BYTES", config=ORT + "max_batch_size: 8\n")


@dataclass
class Finding:
    frontend: str
    kind: str
    outcome: str
    detail: str
    case_index: int
    known: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "frontend": self.frontend,
            "kind": self.kind,
            "outcome": self.outcome,
            "detail": self.detail[:600],
            "case": self.case_index,
            "known": self.known,
        }


@dataclass
class Stats:
    requests: Counter[str] = field(default_factory=Counter)  # per frontend
    classes: dict[str, Counter[str]] = field(default_factory=dict)  # frontend -> status class -> n
    findings: list[Finding] = field(default_factory=list)
    known: list[Finding] = field(default_factory=list)
    batches: int = 0
    checks: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, frontend: str, outcome: str) -> None:
        with self.lock:
            self.requests[frontend] += 1
            self.classes.setdefault(frontend, Counter())[outcome] += 1

    def add(self, finding: Finding) -> None:
        for reason, pattern in KNOWN:
            if finding.outcome in ("5xx", "INTERNAL") and pattern.search(finding.detail):
                finding.known = reason
                break
        with self.lock:
            (self.known if finding.known else self.findings).append(finding)


# -- the engine -------------------------------------------------------------------------------------
@dataclass
class Options:
    seconds: float = 60.0
    max_requests: int = 0  # 0 = bounded by time only
    seed: int = 0
    frontends: tuple[str, ...] = FRONTENDS
    batch: int = 50
    timeout: float = 10.0
    log: Callable[[str], None] = print


class Fuzzer:
    def __init__(self, server: RunningServer, options: Options) -> None:
        self.server = server
        self.options = options
        self.stats = Stats()
        self.failed: list[str] = []  # crash / failed correct request / hang
        self.stop = threading.Event()

    def run(self) -> Stats:
        start = time.monotonic()
        threads = [
            threading.Thread(target=self._worker, args=(name,), name=f"fuzz-{name}", daemon=True)
            for name in self.options.frontends
        ]
        for thread in threads:
            thread.start()
        deadline = start + self.options.seconds
        while any(t.is_alive() for t in threads):
            if time.monotonic() > deadline + self.options.timeout * 6:
                self.failed.append("a fuzz worker did not stop (hang)")
                self.stop.set()
                break
            if not self.server.alive():
                self.failed.append(f"the server exited with {self.server.process.returncode}")
                self.stop.set()
            for thread in threads:
                thread.join(0.2)
        self.duration = time.monotonic() - start
        return self.stats

    def _worker(self, frontend: str) -> None:
        seed = self.options.seed * 1000003 + FRONTENDS.index(frontend)
        rng = random.Random(seed)
        deadline = time.monotonic() + self.options.seconds
        per_frontend_max = self.options.max_requests // max(1, len(self.options.frontends))
        index = 0
        sender: Any
        ring: Ring | None = None
        try:
            if frontend.startswith("http"):
                sender = HttpSender(self.server, self.options.timeout)
                check: Callable[[], None] = lambda: http_correct(sender)  # noqa: E731
            elif frontend.startswith("grpc"):
                sender = GrpcSender(self.server, self.options.timeout)
                check = lambda: grpc_correct(sender)  # noqa: E731
            else:
                sender = ZmqSender(self.server, self.options.timeout)
                check = lambda: zmq_correct(sender)  # noqa: E731
                if frontend == "shm_ring":
                    ring = Ring(sender)
            while not self.stop.is_set() and time.monotonic() < deadline:
                if per_frontend_max and index >= per_frontend_max:
                    break
                for _ in range(self.options.batch):
                    self._one(frontend, rng, sender, index, ring)
                    index += 1
                with self.stats.lock:
                    self.stats.batches += 1
                if not self.server.alive():
                    return
                try:
                    status, _, _ = HttpSender(self.server, self.options.timeout).request(
                        "GET", "/v2/health/live"
                    )
                    assert status == 200, f"/v2/health/live answered {status}"
                    check()
                    with self.stats.lock:
                        self.stats.checks += 1
                except Exception as exc:
                    self.failed.append(
                        f"{frontend}: the correct request after batch ending at case {index} "
                        f"failed: {exc!r}{self._port_thieves()}"
                    )
                    self.stop.set()
                    return
        except Exception as exc:
            self.failed.append(f"{frontend}: the fuzz worker failed at case {index}: {exc!r}")
            self.stop.set()
        finally:
            if ring is not None:
                ring.close()

    def _port_thieves(self) -> str:
        """Other processes listening on our ports (a test elsewhere on this machine), to tell a port
        collision from a server bug."""
        try:
            import psutil

            ports = {self.server.http_port, self.server.grpc_port}
            others = {
                c.pid
                for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN
                and c.laddr
                and c.laddr.port in ports
                and c.pid not in (None, self.server.process.pid)
            }
        except Exception:
            return ""
        return (
            f" (port collision: processes {sorted(others)} also listen on {sorted(ports)})" if others else ""
        )

    def _one(self, frontend: str, rng: random.Random, sender: Any, index: int, ring: Ring | None) -> None:
        kind = "?"
        case = None
        try:
            if frontend == "http_json":
                case: Any = http_json_case(rng)
                kind = case.kind
                outcome, detail = sender.send(case)
            elif frontend == "http_binary":
                case = http_binary_case(rng)
                kind = case.kind
                outcome, detail = sender.send(case)
            elif frontend == "grpc_unary":
                case = grpc_unary_case(rng)
                kind = case.kind
                outcome, detail = sender.send(case)
            elif frontend == "grpc_stream":
                case = grpc_stream_case(rng)
                kind = case.kind
                outcome, detail, _ = sender.send_stream(case)
            elif frontend == "zmq":
                case = zmq_case(rng)
                kind = case.kind
                outcome, detail = sender.send(case)
            else:
                assert ring is not None
                ring.corrupt(rng)
                case = ring_case(rng, ring.info)
                kind = case.kind
                outcome, detail = sender.send(case)
        except TimeoutError as exc:
            if isinstance(sender, HttpSender):
                sender.close()
            outcome, detail = "hang", repr(exc)
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            if isinstance(sender, HttpSender):
                sender.close()
            outcome, detail = "connection_error", repr(exc)
        self.stats.count(frontend, outcome)
        if outcome in (
            "5xx",
            "INTERNAL",
            "UNKNOWN",
            "DATA_LOSS",
            "UNIMPLEMENTED",
            "hang",
            "missing_answers",
            "bad_reply",
        ) or (outcome == "connection_error" and not self.server.alive()):
            self.stats.add(Finding(frontend, kind, outcome, f"{detail} | request: {_describe(case)}", index))

    def report(self) -> dict[str, Any]:
        s = self.stats
        return {
            "seed": self.options.seed,
            "seconds_requested": self.options.seconds,
            "duration_s": round(getattr(self, "duration", 0.0), 1),
            "frontends": list(self.options.frontends),
            "requests": dict(s.requests),
            "total_requests": sum(s.requests.values()),
            "status_classes": {k: dict(v) for k, v in s.classes.items()},
            "batches": s.batches,
            "correct_request_checks": s.checks,
            "findings": len(s.findings),
            "server_errors": sum(1 for f in s.findings if f.outcome not in ("hang", "missing_answers")),
            "hangs": sum(1 for f in s.findings if f.outcome in ("hang", "missing_answers")),
            "crashes": sum(1 for f in self.failed if "exited" in f),
            "failures": list(self.failed),
            "known_shm": len(s.known),
            "finding_samples": _samples(s.findings),
            "known_samples": _samples(s.known),
            "server_alive": self.server.alive(),
        }

    def ok(self) -> bool:
        return not self.failed and not self.stats.findings and self.server.alive()


def _describe(case: Any) -> str:
    if isinstance(case, HttpCase):
        return f"{case.method} {case.path} {case.headers} {(case.raw or case.body)[:300]!r}"
    if isinstance(case, GrpcCase):
        return f"{case.method} {case.payload[:300]!r}"
    if isinstance(case, StreamCase):
        return f"error_mode={case.error_mode} {[p[1][:100] for p in case.payloads]!r}"
    if isinstance(case, ZmqCase):
        return repr([f[:300] for f in case.frames])
    return repr(case)[:300]


def _traceback_kinds(log: str) -> dict[str, int]:
    """The exception line of each traceback in the server's log (what a 5xx came from)."""
    kinds: Counter[str] = Counter()
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            for follow in lines[i + 1 :]:
                if follow and not follow.startswith(" "):
                    kinds[follow[:200]] += 1
                    break
    return dict(kinds.most_common(30))


def _samples(findings: list[Finding], per_kind: int = 3) -> list[dict[str, Any]]:
    seen: Counter[tuple[str, str]] = Counter()
    out = []
    for f in findings:
        key = (f.frontend, f.kind.split("+")[0])
        seen[key] += 1
        if seen[key] <= per_kind:
            out.append(f.as_dict())
    return out


def run(options: Options, workdir: Path | None = None) -> dict[str, Any]:
    """Build the models, start a server, fuzz, stop the server; returns the report (`report["ok"]`)."""
    with contextlib.ExitStack() as stack:
        tmp = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgeserve-fuzz-")))
        repo = tmp / "models"
        build_repository(repo)
        # Explicit limits: the fuzz checks answers to garbage, not the device-sized defaults.
        limits = {
            "EDGESERVE_HTTP_MAX_INPUT_BYTES": str(64 << 20),
            "EDGESERVE_GRPC_MAX_MESSAGE_BYTES": str(64 << 20),
        }
        server = start_server(repo, tmp, env=limits)
        try:
            fuzzer = Fuzzer(server, options)
            fuzzer.run()
            report = fuzzer.report()
            report["ok"] = fuzzer.ok()
            log = server.log()
            report["server_tracebacks"] = log.count("Traceback (most recent call last)")
            report["server_traceback_kinds"] = _traceback_kinds(log)
            # Garbage must not put tracebacks in the log either: that is a bounded-log promise.
            report["ok"] = report["ok"] and report["server_tracebacks"] == 0
        finally:
            code = server.stop()
        report["server_exit_code"] = code
        return report
