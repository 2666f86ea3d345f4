"""The load generator of bench_peers.py: one asyncio caller per transport, all driven the same way (N
concurrent tasks on one event loop in the benchmark process, each task holding one client connection
or stream with one request in flight), so every side gets the same clients and the same concurrency.

- KServe V2 gRPC unary / streaming and HTTP: tritonclient's asyncio clients (edgeserve, PyTriton,
  MLServer). HTTP sends binary tensors (Triton's binary-data extension) where the server has it and
  JSON tensors where it does not (MLServer).
- Ray Serve: plain HTTP with aiohttp (one pool of N connections), a KServe-V2-shaped JSON body, or
  the raw float32 bytes with the shape in a header.
- ZeroMQ / ZeroMQ + shm: edgeserve's AsyncZmqClient, one per task; + shm: each client owns a ring of
  2 slots and copies the input into a slot per request with the documented `Slot.write(array)`.

Each call returns the output as numpy, checked against the in-process output before timing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
from common import Workload


class Caller:
    """`clients` independent connections; each concurrent task borrows one for one request."""

    def __init__(self, target: str, work: Workload, x: np.ndarray, clients: int) -> None:
        self.target, self.work, self.x, self.clients = target, work, x, clients
        self.free: asyncio.Queue[Any] = asyncio.Queue()
        self.all: list[Any] = []

    def add(self, item: Any) -> None:
        self.all.append(item)
        self.free.put_nowait(item)

    async def open(self) -> None:
        for _ in range(self.clients):
            self.add(await self.connect())

    async def connect(self) -> Any:
        raise NotImplementedError

    async def call(self, conn: Any) -> np.ndarray:
        raise NotImplementedError

    async def disconnect(self, conn: Any) -> None:
        return None

    async def __call__(self) -> np.ndarray:
        conn = await self.free.get()
        try:
            out = await self.call(conn)
        finally:
            self.free.put_nowait(conn)
        if out is None or out.size == 0:
            raise RuntimeError("no output in the reply")
        return out

    async def close(self) -> None:
        for conn in self.all:
            await self.disconnect(conn)


class GrpcUnary(Caller):
    async def connect(self) -> Any:
        import tritonclient.grpc.aio as aio

        client = aio.InferenceServerClient(self.target)
        tensor = aio.InferInput(self.work.input_name, list(self.x.shape), "FP32")
        tensor.set_data_from_numpy(self.x)
        return client, [tensor], [aio.InferRequestedOutput(self.work.output_name)]

    async def call(self, conn: Any) -> np.ndarray:
        client, inputs, outputs = conn
        result = await client.infer(self.work.model, inputs, outputs=outputs)
        return result.as_numpy(self.work.output_name)  # type: ignore[no-any-return]

    async def disconnect(self, conn: Any) -> None:
        await conn[0].close()


class Stream:
    """One ModelStreamInfer stream with one request in flight at a time (bench_grpc uses it too)."""

    def __init__(self, client: Any, request: dict[str, Any]) -> None:
        self.client, self.request = client, request
        self.requests: asyncio.Queue[Any] = asyncio.Queue()

        async def feed() -> Any:
            while True:
                item = await self.requests.get()
                if item is None:
                    return
                yield item

        self.responses = client.stream_infer(feed())

    async def roundtrip(self) -> Any:
        """Send the request once; its result (an error in the stream is raised)."""
        self.requests.put_nowait(dict(self.request))
        result, error = await self.responses.__anext__()
        if error is not None:
            raise error
        return result


class GrpcStream(GrpcUnary):
    """ModelStreamInfer: one bidirectional stream per client, one request in flight on it."""

    async def connect(self) -> Any:
        client, inputs, outputs = await super().connect()
        return Stream(client, {"model_name": self.work.model, "inputs": inputs, "outputs": outputs})

    async def call(self, conn: Any) -> np.ndarray:
        result = await conn.roundtrip()
        return result.as_numpy(self.work.output_name)  # type: ignore[no-any-return]

    async def disconnect(self, conn: Any) -> None:
        conn.requests.put_nowait(None)
        await conn.client.close()


class Http(Caller):
    """tritonclient.http.aio: one client with a pool of N connections (binary tensors)."""

    binary = True
    headers: dict[str, str] | None = None

    async def open(self) -> None:
        import tritonclient.http.aio as aio

        self.client = aio.InferenceServerClient(self.target, conn_limit=max(self.clients, 1))
        tensor = aio.InferInput(self.work.input_name, list(self.x.shape), "FP32")
        tensor.set_data_from_numpy(self.x, binary_data=self.binary)
        self.inputs = [tensor]
        self.outputs = [aio.InferRequestedOutput(self.work.output_name, binary_data=self.binary)]
        for _ in range(self.clients):
            self.add(self.client)

    async def call(self, conn: Any) -> np.ndarray:
        result = await conn.infer(self.work.model, self.inputs, outputs=self.outputs, headers=self.headers)
        return result.as_numpy(self.work.output_name)  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self.client.close()


class HttpJson(Http):
    """The same with JSON tensors (for a server without the binary-data extension: MLServer), asking
    for an uncompressed reply (MLServer gzips replies for clients that accept it; tritonclient's
    asyncio client does not inflate them)."""

    binary = False
    headers = {"Accept-Encoding": "identity", "Content-Type": "application/json"}


class RayHttp(Caller):
    """Plain HTTP to a Ray Serve route `/<model>` with aiohttp: a V2-shaped JSON body (encoded per
    request, as tritonclient does) and a JSON reply decoded into numpy."""

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(self.clients, 1)))
        self.url = f"http://{self.target}/{self.work.model}"
        tensor = {
            "name": self.work.input_name,
            "shape": list(self.x.shape),
            "datatype": "FP32",
            "data": self.x.ravel().tolist(),
        }
        self.body = {"inputs": [tensor]}
        for _ in range(self.clients):
            self.add(self.session)

    async def call(self, conn: Any) -> np.ndarray:
        data = json.dumps(self.body)
        async with conn.post(self.url, data=data, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            reply = json.loads(await resp.read())
        out = reply["outputs"][0]
        return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])

    async def close(self) -> None:
        await self.session.close()


class RayHttpRaw(RayHttp):
    """The same route with the float32 bytes as the body and the shape in an `x-shape` header."""

    async def call(self, conn: Any) -> np.ndarray:
        headers = {"content-type": "application/octet-stream", "x-shape": ",".join(map(str, self.x.shape))}
        async with conn.post(self.url, data=self.x.tobytes(), headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            body = await resp.read()
            shape = [int(d) for d in resp.headers["x-shape"].split(",")]
        return np.frombuffer(body, dtype=np.float32).reshape(shape)


class Zmq(Caller):
    """edgeserve's AsyncZmqClient, the input inline in the message (sent without a copy)."""

    async def connect(self) -> Any:
        from edgeserve.client import AsyncZmqClient

        return AsyncZmqClient(self.target, timeout=60, copy_inputs=False)

    async def call(self, conn: Any) -> np.ndarray:
        result = await conn.infer(self.work.model, {self.work.input_name: self.x})
        return result.as_numpy(self.work.output_name)  # type: ignore[no-any-return]

    async def disconnect(self, conn: Any) -> None:
        await conn.close()


class ZmqShm(Zmq):
    """The input copied into a slot of the client's shared-memory ring with `Slot.write` per request
    (the documented API); the server reads it there; the (small) output comes back inline."""

    async def connect(self) -> Any:
        client = await super().connect()
        ring = await client.create_ring(slots=2, slot_size=self.x.nbytes)
        return client, ring

    async def call(self, conn: Any) -> np.ndarray:
        client, ring = conn
        slot = ring.acquire()  # released when the reply comes (the request holds it)
        result = await client.infer(self.work.model, {self.work.input_name: slot.write(self.x)})
        return result.as_numpy(self.work.output_name)  # type: ignore[no-any-return]

    async def disconnect(self, conn: Any) -> None:
        await conn[0].close()


CALLERS: dict[str, type[Caller]] = {
    "gRPC unary": GrpcUnary,
    "gRPC stream": GrpcStream,
    "HTTP": Http,
    "HTTP JSON": HttpJson,
    "HTTP aiohttp JSON": RayHttp,
    "HTTP aiohttp raw": RayHttpRaw,
    "ZeroMQ": Zmq,
    "ZeroMQ + shm": ZmqShm,
}


async def one_call(caller: Caller) -> np.ndarray:
    """Open, one request, close: the output checked before timing."""
    await caller.open()
    try:
        return await caller()
    finally:
        await caller.close()
