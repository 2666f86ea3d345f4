"""Long-lived shared-memory clients, each run as a real user, for tests/security/test_shm_binding.py.

`Session(uid)` starts this file as a child (as root, so it can import everything), which drops to
`uid` for good (shm_helpers' client) and then answers one JSON step per line, so a victim keeps its
ZeroMQ socket, its regions and its camera ring while an attacker (another Session) tries them.
Steps are those of shm_helpers (create, read, register, echo) plus:

- {"do": "overwrite", "via", "at", "out_region", "data": hex}: infer the identity model with `data`
  inline, its output written into `out_region`
- {"do": "status", "via", "at", "name"?} -> {"names": [...]} (the regions the server lists to it)
- {"do": "unregister", "via", "at", "name"} ("" = all of them)
- {"do": "camera", "at", "data": hex}: a FrameRing (sealed memfd) with `data` in a slot that stays in
  flight -> {"name", "key"}
- {"do": "camera_bytes"}: every byte of that ring -> {"data": hex}
"""

from __future__ import annotations

import http.client
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from shm_helpers import MODEL, D, _Client, _drop_to, _http

SIZE = 4 * D  # bytes of the identity model's tensor


class Session:
    """A client process acting as `uid`; `step(...)` sends one step and waits for its answer."""

    def __init__(self, uid: int, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(uid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            _, err = self.process.communicate(timeout=10)
            raise RuntimeError(f"the client process gave no answer:\n{err[-3000:]}")
        return line.strip()

    def step(self, **step: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(step) + "\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self._line())
        return answer

    def close(self) -> None:
        """Closes its rings and sockets (so its ZeroMQ regions go) and waits for it."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the client process ------------------------------------------------------------------------------
class _BindingClient(_Client):
    def __init__(self) -> None:
        super().__init__()
        self.camera: Any = None

    def do_status(self, step: dict[str, Any]) -> dict[str, Any]:
        via, at, name = step["via"], step["at"], step.get("name", "")
        if via == "zmq":
            return {"ok": True, "names": [r["name"] for r in self.zmq_client(at).regions(name)]}
        if via == "grpc":
            regions = self.grpc_client(at).get_system_shared_memory_status(region_name=name).regions
            return {"ok": True, "names": list(regions)}
        host, _, port = at.rpartition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=20)
        try:
            connection.request(
                "GET", "/v2/systemsharedmemory" + (f"/region/{name}" if name else "") + "/status"
            )
            response = connection.getresponse()
            body = json.loads(response.read() or b"null")
        finally:
            connection.close()
        if response.status != 200:
            return {"error": str(response.status), "message": body.get("error", "")}
        return {"ok": True, "names": [entry["name"] for entry in body]}

    def do_unregister(self, step: dict[str, Any]) -> dict[str, Any]:
        via, at, name = step["via"], step["at"], step["name"]
        if via == "zmq":
            self.zmq_client(at).unregister_region(name)
        elif via == "grpc":
            self.grpc_client(at).unregister_system_shared_memory(name)
        else:
            path = "/v2/systemsharedmemory" + (f"/region/{name}" if name else "") + "/unregister"
            answer = _http(at, path, {})
            if answer is not None:
                return answer
        return {"ok": True}

    def do_overwrite(self, step: dict[str, Any]) -> dict[str, Any]:
        via, at, out = step["via"], step["at"], step["out_region"]
        np = self.np
        data = np.frombuffer(bytes.fromhex(step["data"]), np.float32).reshape(1, D)
        if via == "zmq":
            outputs = {"OUTPUT0": self.ShmTensor(out, SIZE, 0, "FP32", (1, D))}
            self.zmq_client(at).infer(MODEL, {"INPUT0": data}, outputs)
        elif via == "grpc":
            grpcclient = self.grpcclient
            inp = grpcclient.InferInput("INPUT0", [1, D], "FP32")
            inp.set_data_from_numpy(data)
            wanted = grpcclient.InferRequestedOutput("OUTPUT0")
            wanted.set_shared_memory(out, SIZE)
            self.grpc_client(at).infer(MODEL, [inp], outputs=[wanted])
        else:
            params = {"shared_memory_region": out, "shared_memory_byte_size": SIZE}
            request = {
                "inputs": [
                    {"name": "INPUT0", "datatype": "FP32", "shape": [1, D], "data": data.ravel().tolist()}
                ],
                "outputs": [{"name": "OUTPUT0", "parameters": params}],
            }
            answer = _http(at, f"/v2/models/{MODEL}/infer", request)
            if answer is not None and "error" in answer:
                return answer
        return {"ok": True}

    def do_camera(self, step: dict[str, Any]) -> dict[str, Any]:
        np = self.np
        ring = self.zmq_client(step["at"]).create_ring(slots=2, slot_size=4 * D)
        self.rings.append(ring)
        self.camera = ring
        slot = ring.acquire()  # a frame in flight: the camera's own requests read it
        slot.ndarray((1, D), np.float32)[:] = np.frombuffer(bytes.fromhex(step["data"]), np.float32)
        return {"ok": True, "name": ring.name, "key": ring.key}

    def do_camera_bytes(self, step: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "data": bytes(self.camera.buf).hex()}


def main() -> None:
    uid = int(sys.argv[1])
    client = _BindingClient()  # every import happens here, while the files are still readable
    _drop_to(uid)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(client.step(json.loads(line))), flush=True)
    for ring in client.rings:
        ring.close()
    for zmq_client in client.zmq.values():
        zmq_client.close()
    os._exit(0)  # grpc's threads would keep a normal exit waiting


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
