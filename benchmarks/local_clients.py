"""The clients of bench_local.py: one `Caller` per mode, the timed loop, and one phase (N clients of
one mode, each remote client in its own process, the in-process clients as threads of this one)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from common import CpuMeter

MODEL = "frame_pool"
SHAPE = (1, 3, 224, 224)  # FP32: 602,112 bytes
OUT = 1024  # FP32 [1,1024]: 4 KB


def frame() -> np.ndarray:
    return np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)


# -- the clients (each remote client runs in its own process) ------------------------------------------
class Caller:
    """One client of one mode: `call()` does one round trip and returns OUTPUT0."""

    def __init__(self, mode: str, target: dict[str, Any]) -> None:
        self.mode = mode
        self.x = frame()
        self.close: Callable[[], None] = lambda: None
        if mode == "inproc":
            self.call = self._inproc_call(target)
        elif mode.startswith("zmq"):
            self.call = self._zmq_call(mode, target["zmq"])
        else:
            self.call = self._grpc_call(mode, target["grpc"])

    def _inproc_call(self, target: dict[str, Any]) -> Any:
        instance = target["instance"]
        return lambda: instance.infer({"INPUT0": self.x})["OUTPUT0"]

    def _zmq_call(self, mode: str, endpoint: str) -> Any:
        from edgeserve.client import ZmqClient
        from edgeserve.client.zmq_client import DEFAULT_SPIN_US

        spin = 0 if mode == "zmq_shm_nospin" else DEFAULT_SPIN_US
        client = ZmqClient(endpoint, timeout=30, copy_inputs=False, spin_us=spin)
        self.close = client.close
        x = self.x
        if mode == "zmq_inline":
            return lambda: client.infer(MODEL, {"INPUT0": x}).as_numpy("OUTPUT0")
        ring = client.create_ring(slots=2, slot_size=x.nbytes)
        write = mode == "zmq_shm_write"
        slots = [ring.acquire() for _ in range(ring.slots)]
        for slot in slots:  # zmq_shm: the producer wrote the frame into every slot
            slot.ndarray(SHAPE, np.float32)[:] = x
            slot.release()

        def call() -> Any:
            slot = ring.acquire()
            # zmq_shm_write: the producer copies its frame in with the documented API
            tensor = slot.write(x) if write else slot.tensor(SHAPE, np.float32)
            return client.infer(MODEL, {"INPUT0": tensor}).as_numpy("OUTPUT0")

        return call

    def _grpc_call(self, mode: str, url: str) -> Any:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import shared_memory as triton_shm

        client = grpcclient.InferenceServerClient(url)
        x = self.x
        output = [grpcclient.InferRequestedOutput("OUTPUT0")]
        if mode == "grpc_plain":

            def plain() -> Any:
                inp = grpcclient.InferInput("INPUT0", list(SHAPE), "FP32")
                inp.set_data_from_numpy(x)
                return client.infer(MODEL, [inp], outputs=output).as_numpy("OUTPUT0")

            self.close = client.close
            return plain
        name = f"bench_{uuid.uuid4().hex[:8]}"
        handle = triton_shm.create_shared_memory_region(name, "/" + name, x.nbytes)
        client.register_system_shared_memory(name, "/" + name, x.nbytes)

        def close() -> None:
            client.unregister_system_shared_memory(name)
            triton_shm.destroy_shared_memory_region(handle)
            client.close()

        self.close = close

        def shm() -> Any:
            triton_shm.set_shared_memory_region(handle, [x])
            inp = grpcclient.InferInput("INPUT0", list(SHAPE), "FP32")
            inp.set_shared_memory(name, x.nbytes)
            return client.infer(MODEL, [inp], outputs=output).as_numpy("OUTPUT0")

        return shm


def loop(
    caller: Caller, seconds: float, max_requests: int, start: float, fps: float = 0.0
) -> tuple[list[float], float, float]:
    """Calls from `start` (a time.time() shared by all clients) for `seconds`: back to back, or one
    every 1/`fps` s as a camera delivers frames."""
    for _ in range(20):  # warm-up, outside the measurement
        caller.call()
    while time.time() < start:
        time.sleep(0.0005)
    latencies: list[float] = []
    cpu0 = time.process_time()
    period = 1.0 / fps if fps > 0 else 0.0
    deadline = time.perf_counter() + seconds
    tick = time.perf_counter()
    while len(latencies) < max_requests and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        caller.call()
        latencies.append(time.perf_counter() - t0)
        if period:
            tick += period
            time.sleep(max(0.0, tick - time.perf_counter()))
    return latencies, time.time(), time.process_time() - cpu0


def _client_process(
    mode: str, target: dict[str, Any], seconds: float, max_requests: int, start: float, fps: float, queue: Any
) -> None:
    try:
        caller = Caller(mode, target)
        try:
            queue.put(("ok", *loop(caller, seconds, max_requests, start, fps)))
        finally:
            caller.close()
    except BaseException as exc:
        queue.put(("error", repr(exc), 0.0, 0.0))


def run_phase(
    mode: str, clients: int, target: dict[str, Any], seconds: float, server_pid: int, fps: float = 0.0
) -> dict[str, Any]:
    max_requests = 200_000
    start = time.time() + (1.5 if mode == "inproc" else 4.0)  # time to connect / load and warm up
    results: list[tuple[Any, ...]] = []
    meter_pids = {"server": server_pid}
    if mode == "inproc":  # N threads of this process share one session (ORT releases the GIL)
        meter = CpuMeter({"client": os.getpid()})
        caller = Caller(mode, target)
        lock = threading.Lock()

        def worker() -> None:
            out = loop(caller, seconds, max_requests, start, fps)
            with lock:
                results.append(("ok", *out))

        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for thread in threads:
            thread.start()
        while time.time() < start:
            time.sleep(0.001)
        meter.start()
        for thread in threads:
            thread.join(seconds + 120)
        cpu = meter.stop()
    else:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_client_process, args=(mode, target, seconds, max_requests, start, fps, queue))
            for _ in range(clients)
        ]
        for proc in procs:
            proc.start()
        meter = CpuMeter({**meter_pids, **{f"client{i}": p.pid for i, p in enumerate(procs) if p.pid}})
        while time.time() < start:
            time.sleep(0.001)
        meter.start()
        results = [queue.get(timeout=seconds + 120) for _ in procs]
        cpu = meter.stop()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    errors = [r[1] for r in results if r[0] == "error"]
    latencies = [lat for r in results if r[0] == "ok" for lat in r[1]]
    wall = max((r[2] for r in results if r[0] == "ok"), default=start) - start
    client_cpu = sum(v for k, v in cpu.items() if k.startswith("client"))
    return {
        "mode": mode,
        "clients": clients,
        "latencies": latencies,
        "wall": wall,
        "errors": errors,
        "client_cpu_pct": client_cpu,
        "server_cpu_pct": cpu.get("server", 0.0),
    }
