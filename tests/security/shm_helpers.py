"""A shared-memory client run as another user, for tests/security/test_shm_*.py.

`run_as(uid, steps)` starts this file with the test's interpreter (as root: the interpreter lives
where only root may read), which imports every client library it will use, drops to `uid` for good
(setgroups, setgid, setuid) and only then connects and runs `steps`, one JSON object per step:

- {"do": "create", "key", "data": hex, "mode"}: a /dev/shm object of its own, holding `data`
- {"do": "read", "key"}: the bytes of a /dev/shm object -> {"data": hex} or {"error": errno name}
- {"do": "register", "via": "zmq"|"http"|"grpc", "at", "name", "key", "byte_size"}
- {"do": "echo", "via", "at", "region", "byte_size", "out_region"?}: infer the identity model with its
  input read from `region` (and, with `out_region`, its output written there) -> {"data": hex}
- {"do": "ring", "at", "data": hex}: a FrameRing (sealed memfd) of its own, one request in and out
- {"do": "forge", "path", "peer_address", "name", "key", "byte_size"}: a register sent over a raw
  ZMTP connection whose handshake claims its own "Peer-Address" property

Each step answers {"ok": true, ...} or {"error": <status>, "message": ...}; ZeroMQ clients stay
connected between steps (a client's regions go when it disconnects).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

D = 256  # FP32 elements of the identity model's input and output: 1 KiB
MODEL = "ident"
CONFIG = f"""
backend: "onnxruntime"
max_batch_size: 8
input {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {D} ] }}
output {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {D} ] }}
"""
NOBODY = 65534


def run_as(uid: int, steps: list[dict[str, Any]], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run `steps` in a fresh client process that acts as `uid`; one answer per step."""
    done = subprocess.run(
        [sys.executable, __file__, str(uid)],
        input=json.dumps(steps),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )
    if done.returncode != 0:
        raise RuntimeError(f"client as uid {uid} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    answers: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


# -- the client process ------------------------------------------------------------------------------
def _drop_to(uid: int) -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started as root: a client's own process could not exec Python
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit("could not drop privileges")


def _error(exc: BaseException) -> dict[str, Any]:
    status = getattr(exc, "status", None)
    status = status() if callable(status) else status
    message = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    return {"error": str(status or type(exc).__name__).replace("StatusCode.", ""), "message": message}


class _Client:
    def __init__(self) -> None:
        import encodings.idna  # noqa: F401  (http.client looks it up on first use)

        import numpy as np
        import tritonclient.grpc as grpcclient

        from edgeserve.client import ZmqClient
        from edgeserve.client.ring import ShmTensor

        self.np, self.grpcclient, self.ZmqClient, self.ShmTensor = np, grpcclient, ZmqClient, ShmTensor
        self.zmq: dict[str, Any] = {}
        self.grpc: dict[str, Any] = {}
        self.rings: list[Any] = []

    def zmq_client(self, at: str) -> Any:
        if at not in self.zmq:
            self.zmq[at] = self.ZmqClient(at, timeout=20.0)
        return self.zmq[at]

    def grpc_client(self, at: str) -> Any:
        if at not in self.grpc:
            self.grpc[at] = self.grpcclient.InferenceServerClient(at)
        return self.grpc[at]

    def step(self, step: dict[str, Any]) -> dict[str, Any]:
        try:
            return getattr(self, "do_" + step["do"])(step)
        except Exception as exc:
            return _error(exc)

    def do_create(self, step: dict[str, Any]) -> dict[str, Any]:
        fd = os.open(f"/dev/shm/{step['key'].lstrip('/')}", os.O_RDWR | os.O_CREAT | os.O_EXCL, step["mode"])
        try:
            os.write(fd, bytes.fromhex(step["data"]))
        finally:
            os.close(fd)
        return {"ok": True}

    def do_read(self, step: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"ok": True, "data": Path(f"/dev/shm/{step['key'].lstrip('/')}").read_bytes().hex()}
        except OSError as exc:
            return {"error": os.strerror(exc.errno or 0), "message": str(exc)}

    def do_register(self, step: dict[str, Any]) -> dict[str, Any]:
        via, at, name, key, size = step["via"], step["at"], step["name"], step["key"], step["byte_size"]
        if via == "zmq":
            self.zmq_client(at).register_region(name, key, size)
        elif via == "grpc":
            self.grpc_client(at).register_system_shared_memory(name, key, size)
        else:
            body = {"key": key, "offset": 0, "byte_size": size}
            answer = _http(at, f"/v2/systemsharedmemory/region/{name}/register", body)
            if answer is not None:
                return answer
        return {"ok": True}

    def do_echo(self, step: dict[str, Any]) -> dict[str, Any]:
        via, at, region, size, out = (
            step["via"],
            step["at"],
            step["region"],
            step["byte_size"],
            step.get("out_region"),
        )
        np = self.np
        if via == "zmq":
            tensor = self.ShmTensor(region, size, 0, "FP32", (1, D))
            outputs = {"OUTPUT0": self.ShmTensor(out, size, 0, "FP32", (1, D))} if out else None
            result = self.zmq_client(at).infer(MODEL, {"INPUT0": tensor}, outputs)
            return {"ok": True, "data": "" if out else result.as_numpy("OUTPUT0").tobytes().hex()}
        if via == "grpc":
            grpcclient = self.grpcclient
            inp = grpcclient.InferInput("INPUT0", [1, D], "FP32")
            inp.set_shared_memory(region, size)
            wanted = grpcclient.InferRequestedOutput("OUTPUT0")
            if out:
                wanted.set_shared_memory(out, size)
            result = self.grpc_client(at).infer(MODEL, [inp], outputs=[wanted])
            return {"ok": True, "data": "" if out else result.as_numpy("OUTPUT0").tobytes().hex()}
        params: dict[str, Any] = {"shared_memory_region": region, "shared_memory_byte_size": size}
        request: dict[str, Any] = {
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, D], "parameters": params}]
        }
        if out:
            request["outputs"] = [
                {
                    "name": "OUTPUT0",
                    "parameters": {"shared_memory_region": out, "shared_memory_byte_size": size},
                }
            ]
        answer = _http(at, f"/v2/models/{MODEL}/infer", request)
        if answer is None or "error" in answer:
            return answer or {"ok": True, "data": ""}
        data = answer["body"]["outputs"][0].get("data", [])
        return {"ok": True, "data": np.asarray(data, dtype=np.float32).tobytes().hex() if data else ""}

    def do_ring(self, step: dict[str, Any]) -> dict[str, Any]:
        np = self.np
        client = self.zmq_client(step["at"])
        ring = client.create_ring(slots=2, slot_size=4 * D)
        self.rings.append(ring)
        slot = ring.acquire()
        slot.ndarray((1, D), np.float32)[:] = np.frombuffer(bytes.fromhex(step["data"]), np.float32)
        result = client.infer(MODEL, {"INPUT0": slot.tensor((1, D), np.float32)}, outputs={"OUTPUT0": ring})
        return {
            "ok": True,
            "sealed": ring.sealed,
            "key": ring.key,
            "data": result.as_numpy("OUTPUT0").tobytes().hex(),
        }

    def do_forge(self, step: dict[str, Any]) -> dict[str, Any]:
        header = {"v": 1, "op": "register", "id": 1, "name": step["name"], "key": step["key"], "offset": 0,
                  "byte_size": step["byte_size"]}  # fmt: skip
        return _zmtp_request(step["path"], step["peer_address"], json.dumps(header).encode())


def _http(at: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """POST JSON; None for an empty 200, {"body": ...} for a JSON 200, else {"error": "<status>", ...}."""
    host, _, port = at.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    parsed = json.loads(data) if data else None
    if response.status != 200:
        return {"error": str(response.status), "message": (parsed or {}).get("error", "")}
    return None if parsed is None else {"ok": True, "body": parsed}


# -- raw ZMTP 3.0 (NULL mechanism), enough for one DEALER request ------------------------------------
def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise ConnectionError("the server closed the connection")
        data += more
    return data


def _frame(flags: int, body: bytes) -> bytes:
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    flags = _recv_exact(sock, 1)[0]
    size = struct.unpack(">Q", _recv_exact(sock, 8))[0] if flags & 0x02 else _recv_exact(sock, 1)[0]
    return flags, _recv_exact(sock, size)


def _zmtp_request(path: str, peer_address: str, header: bytes) -> dict[str, Any]:
    def prop(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(path)
        sock.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32))
        _recv_exact(sock, 64)  # the server's greeting
        ready = b"\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Identity", b"")
        ready += prop(b"Peer-Address", peer_address.encode()) + prop(b"__fd", b"0")
        sock.sendall(_frame(0x04, ready))
        while not _read_frame(sock)[0] & 0x04:  # up to the server's READY command
            pass
        sock.sendall(_frame(0x00, header))
        while True:
            flags, body = _read_frame(sock)
            if flags & 0x04:  # a command (PING): not a reply
                continue
            reply = json.loads(body)
            if reply.get("id") == 1:
                if reply["status"] == "OK":
                    return {"ok": True}
                return {"error": reply["status"], "message": reply.get("message", "")}


def main() -> None:
    uid = int(sys.argv[1])
    steps = json.loads(sys.stdin.read())
    client = _Client()  # every import happens here, while the files are still readable
    _drop_to(uid)
    answers = [client.step(step) for step in steps]
    for ring in client.rings:
        ring.close()
    for zmq_client in client.zmq.values():
        zmq_client.close()
    print(json.dumps(answers), flush=True)
    os._exit(0)  # grpc's threads would keep a normal exit waiting


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
