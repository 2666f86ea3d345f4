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
import json
import random
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import zmq
from tritonclient.grpc import service_pb2

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz_gen as gen  # noqa: E402
from es_server import RunningServer, start_server  # noqa: E402
from onnx_models import write_model  # noqa: E402

FRONTENDS = ("http_json", "http_binary", "grpc_unary", "grpc_stream", "zmq", "shm_ring")
SERVICE = "/inference.GRPCInferenceService/"
ORT = 'backend: "onnxruntime"\n'
BAD_GRPC = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED,
}
UNPARSEABLE = "Unable to parse request"

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


# -- frontends ------------------------------------------------------------------------------------
class HttpSender:
    def __init__(self, server: RunningServer, timeout: float) -> None:
        self.port = server.http_port
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        return self.conn

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        headers = dict(headers or {})
        for attempt in range(2):
            conn = self._connection()
            try:
                conn.request(method, path, body=body, headers=headers or {})
                response = conn.getresponse()
                data = response.read()
                if response.will_close:
                    self.close()
                return response.status, data, dict(response.getheaders())
            except (
                ConnectionError,
                http.client.RemoteDisconnected,
                http.client.CannotSendRequest,
                http.client.BadStatusLine,
            ):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def raw(self, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout) as sock:
            with contextlib.suppress(ConnectionError, BrokenPipeError):
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            chunks = []
            with contextlib.suppress(ConnectionError):
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def send(self, case: gen.HttpCase) -> tuple[str, str]:
        """(status class, detail)."""
        if case.raw is not None:
            reply = self.raw(case.raw)
            match = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
            if not match:
                return "closed", ""
            status = int(match.group(1))
            return _http_class(status, False), reply[:300].decode("latin-1")
        headers: dict[str, Any] = {"Content-Length": str(len(case.body)), **case.headers}
        headers = {k: v.encode("utf-8") if isinstance(v, str) else v for k, v in headers.items()}
        status, data, _ = self.request(case.method, case.path, case.body, headers)
        text = data[:400].decode("utf-8", "replace")
        if status == 503 and "Request timeout expired" in text and b'"timeout"' in case.body:
            return "503-client-timeout", text  # the client asked for a timeout that expired
        return _http_class(status, case.allow_501), f"{status} {text}"


def _http_class(status: int, allow_501: bool) -> str:
    if status >= 500:
        return "501-unsupported" if status == 501 and allow_501 else "5xx"
    return f"{status // 100}xx"


def http_correct(sender: HttpSender) -> None:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    body = {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": a.reshape(-1).tolist()},
            {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16},
        ]
    }
    status, data, _ = sender.request(
        "POST",
        "/v2/models/check_add_sub/infer",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200, f"correct HTTP request answered {status}: {data[:300]!r}"
    outputs = {o["name"]: o["data"] for o in json.loads(data)["outputs"]}
    assert outputs["OUTPUT0"] == (a + 1).reshape(-1).tolist(), outputs
    blob = b"\x03\x00\x00\x00abc\x00\x00\x00\x00"
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "BYTES",
                    "shape": [1, 2],
                    "parameters": {"binary_data_size": len(blob)},
                }
            ]
        }
    ).encode()
    status, data, _headers = sender.request(
        "POST",
        "/v2/models/check_bytes/infer",
        head + blob,
        {"Inference-Header-Content-Length": str(len(head))},
    )
    assert status == 200, f"correct HTTP binary request answered {status}: {data[:300]!r}"
    assert json.loads(data)["outputs"][0]["data"] == ["abc", ""], data[:300]


class GrpcSender:
    def __init__(self, server: RunningServer, timeout: float) -> None:
        self.channel = grpc.insecure_channel(
            server.grpc_url,
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        )
        self.timeout = timeout
        self.unary: dict[str, Any] = {}
        self.stream = self.channel.stream_stream(
            SERVICE + "ModelStreamInfer", request_serializer=None, response_deserializer=None
        )

    def call(self, method: str, payload: bytes) -> bytes:
        stub = self.unary.get(method)
        if stub is None:
            stub = self.unary[method] = self.channel.unary_unary(SERVICE + method, None, None)
        return stub(payload, timeout=self.timeout)  # type: ignore[no-any-return]

    def send(self, case: gen.GrpcCase) -> tuple[str, str]:
        try:
            self.call(case.method, case.payload)
            return "OK", ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.UNIMPLEMENTED and case.method != "ModelInfer":
                return (
                    "UNIMPLEMENTED-unsupported",
                    details,
                )  # a documented unsupported feature (CUDA shm, ...)
            return _grpc_class(code, details, case.parsed_ok), f"{code.name} {details}"

    def send_stream(self, case: gen.StreamCase) -> tuple[str, str, int]:
        """(class, detail, responses); every request must get one response (or the stream ends on error)."""
        metadata = (("triton_grpc_error", "true"),) if case.error_mode else ()
        payloads = [p[1] for p in case.payloads]
        all_parse = all(p[2] for p in case.payloads)
        worst, detail, answers = "OK", "", 0
        try:
            for raw in self.stream(iter(payloads), timeout=self.timeout, metadata=metadata):
                answers += 1
                msg = service_pb2.ModelStreamInferResponse.FromString(raw)
                if msg.error_message:
                    bad = msg.error_message.startswith("internal error") or (
                        msg.error_message.startswith(UNPARSEABLE) and all_parse
                    )
                    if bad:
                        worst, detail = "INTERNAL", msg.error_message
                    elif worst == "OK":
                        worst = "error_message"
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "hang", f"stream: {answers} of {len(payloads)} answers in {self.timeout}s", answers
            cls = _grpc_class(code, exc.details() or "", all_parse)
            return cls, f"{code.name} {exc.details()}", answers
        if answers != len(payloads):
            return "missing_answers", f"{answers} answers to {len(payloads)} requests", answers
        return worst, detail, answers

    def close(self) -> None:
        self.channel.close()


def _grpc_class(code: grpc.StatusCode, details: str, parsed_ok: bool) -> str:
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "hang"
    if code == grpc.StatusCode.INTERNAL and details.startswith(UNPARSEABLE) and not parsed_ok:
        return "INTERNAL-unparseable"  # the documented exception
    if code in BAD_GRPC:
        return "INTERNAL" if code == grpc.StatusCode.INTERNAL else code.name
    return code.name


def grpc_correct(sender: GrpcSender) -> None:
    msg = service_pb2.ModelInferRequest(model_name="check_add_sub")
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        msg.raw_input_contents.append(a.tobytes())
    reply = service_pb2.ModelInferResponse.FromString(sender.call("ModelInfer", msg.SerializeToString()))
    names = [o.name for o in reply.outputs]
    out0 = np.frombuffer(reply.raw_output_contents[names.index("OUTPUT0")], np.float32)
    assert np.array_equal(out0, (a * 2).reshape(-1)), out0
    answers = list(sender.stream(iter([msg.SerializeToString()] * 2), timeout=sender.timeout))
    assert len(answers) == 2, answers
    for raw in answers:
        stream_reply = service_pb2.ModelStreamInferResponse.FromString(raw)
        assert not stream_reply.error_message, stream_reply.error_message


class ZmqSender:
    def __init__(self, server: RunningServer, timeout: float) -> None:
        self.endpoint = server.zmq_endpoint
        self.timeout = timeout
        self.context = zmq.Context.instance()
        self.socket = self._socket()

    def _socket(self) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def exchange(self, frames: list[bytes], expect_reply: bool = True) -> list[bytes] | None:
        self.socket.send_multipart(frames)
        if not expect_reply:
            return None
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(left * 1000) + 1):
                return None
            reply = self.socket.recv_multipart()
            if len(reply) > 1 and not reply[0]:  # we sent an empty first frame (a REQ delimiter)
                reply = reply[1:]
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                if json.loads(reply[0]).get("op") == "probe":  # the server checking we are still here
                    continue
            return reply

    def send(self, case: gen.ZmqCase) -> tuple[str, str]:
        reply = self.exchange(case.frames, case.expect_reply)
        if not case.expect_reply:
            return "no_reply_expected", ""
        if reply is None:
            self.socket.close()
            self.socket = self._socket()  # drop a late reply with the socket
            return "hang", f"no reply in {self.timeout}s"
        try:
            header = json.loads(reply[0])
            status = str(header.get("status"))
        except (ValueError, AttributeError) as exc:
            return "bad_reply", f"unparseable reply header: {exc}: {reply[0][:200]!r}"
        if status in ("INTERNAL", "UNKNOWN"):
            return "INTERNAL", f"{status} {header.get('message')}"
        return status, ""

    def close(self) -> None:
        self.socket.close()


def zmq_correct(sender: ZmqSender) -> None:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    header = {
        "v": 1,
        "op": "infer",
        "id": "check",
        "model": "check_add_sub",
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16]},
            {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16]},
        ],
    }
    reply = sender.exchange([json.dumps(header).encode(), a.tobytes(), a.tobytes()])
    assert reply is not None, "no reply to a correct ZeroMQ request"
    head = json.loads(reply[0])
    assert head["status"] == "OK" and head["id"] == "check", head
    names = [o["name"] for o in head["outputs"]]
    out0 = np.frombuffer(reply[1 + names.index("OUTPUT0")], np.float32)
    assert np.array_equal(out0, (a * 2).reshape(-1)), out0


class Ring:
    """A real frame ring (edgeserve.client.ring.FrameRing layout) registered over ZeroMQ, whose header
    the fuzzer may also corrupt (an adversarial producer)."""

    def __init__(self, sender: ZmqSender) -> None:
        from edgeserve.client.ring import FrameRing

        self.ring = FrameRing(4, 256, name=f"fuzz-ring-{id(self):x}")
        self.buf: memoryview = self._buffer()
        self.pristine = bytes(self.buf[:4096])
        reg = {
            "v": 1,
            "op": "register",
            "id": 1,
            "name": self.ring.name,
            "key": self.ring.key,
            "byte_size": self.ring.byte_size,
        }
        reply = sender.exchange([json.dumps(reg).encode()])
        assert reply is not None and json.loads(reply[0])["status"] == "OK", reply
        self.info = {"name": self.ring.name, "slots": 4, "slot_size": self.ring.layout.slot_size}

    def _buffer(self) -> memoryview:
        buf = getattr(self.ring, "buf", None)  # the ring's mapping (FrameRing.buf, or its SharedMemory's)
        return buf if buf is not None else self.ring._shm.buf

    def corrupt(self, rng: random.Random) -> None:
        buf = self.buf
        buf[:4096] = self.pristine
        if rng.random() < 0.3:
            at = rng.choice([0, 8, 12, 16, 24, 32, 40, 64, 72])
            buf[at : at + 8] = bytes(rng.randrange(256) for _ in range(8))

    def close(self) -> None:
        self.buf = memoryview(b"")
        self.ring.close()


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
                case: Any = gen.http_json_case(rng)
                kind = case.kind
                outcome, detail = sender.send(case)
            elif frontend == "http_binary":
                case = gen.http_binary_case(rng)
                kind = case.kind
                outcome, detail = sender.send(case)
            elif frontend == "grpc_unary":
                case = gen.grpc_unary_case(rng)
                kind = case.kind
                outcome, detail = sender.send(case)
            elif frontend == "grpc_stream":
                case = gen.grpc_stream_case(rng)
                kind = case.kind
                outcome, detail, _ = sender.send_stream(case)
            elif frontend == "zmq":
                case = gen.zmq_case(rng)
                kind = case.kind
                outcome, detail = sender.send(case)
            else:
                assert ring is not None
                ring.corrupt(rng)
                case = gen.ring_case(rng, ring.info)
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
    if isinstance(case, gen.HttpCase):
        return f"{case.method} {case.path} {case.headers} {(case.raw or case.body)[:300]!r}"
    if isinstance(case, gen.GrpcCase):
        return f"{case.method} {case.payload[:300]!r}"
    if isinstance(case, gen.StreamCase):
        return f"error_mode={case.error_mode} {[p[1][:100] for p in case.payloads]!r}"
    if isinstance(case, gen.ZmqCase):
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
