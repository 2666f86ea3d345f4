"""The fuzz engine's senders, one per frontend: each puts a generated case on its wire and tells the
answer's class (ok, client error, server error, hang), and sends the correct request that must still
answer correctly after every batch (fuzz_engine.py runs them).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import socket
import sys
import time
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

from es_server import RunningServer  # noqa: E402
from fuzz_gen_grpc import GrpcCase, StreamCase  # noqa: E402
from fuzz_gen_http import HttpCase  # noqa: E402
from fuzz_gen_zmq import ZmqCase  # noqa: E402

SERVICE = "/inference.GRPCInferenceService/"
BAD_GRPC = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED,
}
UNPARSEABLE = "Unable to parse request"


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

    def send(self, case: HttpCase) -> tuple[str, str]:
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

    def send(self, case: GrpcCase) -> tuple[str, str]:
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

    def send_stream(self, case: StreamCase) -> tuple[str, str, int]:
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

    def send(self, case: ZmqCase) -> tuple[str, str]:
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
