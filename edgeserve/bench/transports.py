"""One request over each protocol, with everything that can be prepared before the measurement done
before it: request bodies are built once per sample, so the clock covers only the round trip.

A transport has `lanes`: independent clients (gRPC channels, streams, ZeroMQ sockets + rings) that the
load driver spreads its requests over; at concurrency N there are N lanes, one request in flight each,
as perf_analyzer's N contexts. Outputs are read whole but not decoded (the server's work and the bytes
on the wire are measured, not numpy's), except in `HttpTransport.outputs`, which `tune` uses to check
accuracy.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.bench.api import grpc_metadata, grpc_target, http_base
from edgeserve.bench.errors import RequestError
from edgeserve.bench.inputs import ModelInfo, Sample
from edgeserve.protocol import datatypes

PROTOCOLS = ("http", "http-json", "grpc", "grpc-stream", "zmq", "zmq-shm")
_HEADER = "Inference-Header-Content-Length"
RING_BYTES_MAX = 256 << 20  # all rings of one transport together


def _wire(array: npt.NDArray[Any], datatype: str) -> bytes:
    return bytes(datatypes.to_wire_bytes(array, datatype))


class Transport(abc.ABC):
    protocol = ""

    def __init__(
        self,
        url: str,
        info: ModelInfo,
        samples: Sequence[Sample],
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url, self.info, self.samples, self.timeout_s = url, info, list(samples), timeout_s
        self.headers = dict(headers or {})  # HTTP headers / gRPC metadata on every request (-H)
        self.datatypes = {t.name: t.datatype for t in info.inputs}

    @abc.abstractmethod
    async def open(self, lanes: int, inflight_per_lane: int = 1) -> None: ...

    @abc.abstractmethod
    async def infer(self, lane: int, index: int) -> None:
        """One round trip with sample `index` (mod the sample count); RequestError when it fails."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class HttpTransport(Transport):
    """KServe V2 over HTTP with Triton's binary tensor extension (tensors as raw bytes after the JSON)."""

    protocol = "http"

    def _bodies(self) -> list[tuple[bytes, dict[str, str]]]:
        outputs = [{"name": t.name, "parameters": {"binary_data": True}} for t in self.info.outputs]
        bodies: list[tuple[bytes, dict[str, str]]] = []
        for sample in self.samples:
            raw = {name: _wire(array, self.datatypes[name]) for name, array in sample.items()}
            header = json.dumps(
                {
                    "inputs": [
                        {
                            "name": name,
                            "shape": list(array.shape),
                            "datatype": self.datatypes[name],
                            "parameters": {"binary_data_size": len(raw[name])},
                        }
                        for name, array in sample.items()
                    ],
                    "outputs": outputs,
                }
            ).encode()
            headers = {_HEADER: str(len(header)), "Content-Type": "application/octet-stream"}
            bodies.append((header + b"".join(raw.values()), headers))
        return bodies

    async def open(self, lanes: int, inflight_per_lane: int = 1) -> None:
        import aiohttp

        base = http_base(self.url) + f"/v2/models/{self.info.name}"
        self.endpoint = base + (f"/versions/{self.info.version}" if self.info.version else "") + "/infer"
        self.bodies = self._bodies()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self.headers
        )

    async def _post(self, index: int) -> tuple[int, bytes, Any]:
        import aiohttp

        body, headers = self.bodies[index % len(self.bodies)]
        try:
            async with self.session.post(self.endpoint, data=body, headers=headers) as response:
                return response.status, await response.read(), response.headers
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise RequestError(f"HTTP: {exc or type(exc).__name__}") from None

    async def infer(self, lane: int, index: int) -> None:
        status, raw, _ = await self._post(index)
        if status != 200:
            raise RequestError(f"HTTP {status}: {raw[:300].decode(errors='replace')}")

    async def outputs(self, index: int) -> dict[str, npt.NDArray[Any]]:
        """One request, its outputs decoded (binary tensor extension or JSON data)."""
        status, raw, headers = await self._post(index)
        if status != 200:
            raise RequestError(f"HTTP {status}: {raw[:300].decode(errors='replace')}")
        length = int(headers.get(_HEADER, len(raw)))
        header = json.loads(raw[:length])
        offset, result = length, {}
        for out in header.get("outputs", []):
            shape = tuple(int(d) for d in out["shape"])
            size = (out.get("parameters") or {}).get("binary_data_size")
            if size is None:
                result[out["name"]] = np.asarray(out["data"], dtype=datatypes.numpy_dtype(out["datatype"]))
                result[out["name"]] = result[out["name"]].reshape(shape)
                continue
            chunk = raw[offset : offset + int(size)]
            offset += int(size)
            result[out["name"]] = datatypes.from_buffer(chunk, out["datatype"], shape, out["name"]).copy()
        return result

    async def close(self) -> None:
        with contextlib.suppress(AttributeError):
            await self.session.close()


class HttpJsonTransport(HttpTransport):
    """KServe V2 over HTTP, tensors as JSON lists: the core protocol every V2 server speaks (slower)."""

    protocol = "http-json"

    def _bodies(self) -> list[tuple[bytes, dict[str, str]]]:
        def data(array: npt.NDArray[Any]) -> list[Any]:
            flat = array.ravel().tolist()
            return [v.decode(errors="replace") if isinstance(v, bytes) else v for v in flat]

        outputs = [{"name": t.name} for t in self.info.outputs]
        return [
            (
                json.dumps(
                    {
                        "inputs": [
                            {
                                "name": n,
                                "shape": list(a.shape),
                                "datatype": self.datatypes[n],
                                "data": data(a),
                            }
                            for n, a in sample.items()
                        ],
                        "outputs": outputs,
                    }
                ).encode(),
                {"Content-Type": "application/json"},
            )
            for sample in self.samples
        ]


def _infer_request_bytes(info: ModelInfo, sample: Sample, types: dict[str, str]) -> bytes:
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=info.name, model_version=info.version)
    for name, array in sample.items():
        request.inputs.add(name=name, datatype=types[name], shape=list(array.shape))
        request.raw_input_contents.append(_wire(array, types[name]))
    for out in info.outputs:
        request.outputs.add(name=out.name)
    return bytes(request.SerializeToString())


def _id_field(value: int) -> bytes:
    """ModelInferRequest.id (field 3, a string) as bytes appended to a serialized request: protobuf
    merges fields in any order, so one prebuilt body serves every request id."""
    text = str(value).encode()
    return b"\x1a" + bytes([len(text)]) + text


class GrpcTransport(Transport):
    """ModelInfer, one channel per lane; requests serialized once, replies not parsed."""

    protocol = "grpc"
    _path = "/inference.GRPCInferenceService/ModelInfer"

    async def open(self, lanes: int, inflight_per_lane: int = 1) -> None:
        import grpc

        self.bodies = [_infer_request_bytes(self.info, s, self.datatypes) for s in self.samples]
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.channels = [
            grpc.aio.insecure_channel(grpc_target(self.url), options=options) for _ in range(lanes)
        ]
        self.calls = [ch.unary_unary(self._path) for ch in self.channels]
        self.metadata = grpc_metadata(self.headers)

    async def infer(self, lane: int, index: int) -> None:
        import grpc

        try:
            await self.calls[lane](
                self.bodies[index % len(self.bodies)], timeout=self.timeout_s, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise RequestError(f"gRPC {exc.code().name}: {exc.details()}") from None

    async def close(self) -> None:
        for channel in getattr(self, "channels", []):
            await channel.close()


class _Stream:
    """One ModelStreamInfer stream; replies matched to requests by id, so several may be in flight."""

    def __init__(self, channel: Any, timeout_s: float, metadata: Any) -> None:
        from tritonclient.grpc import service_pb2 as pb

        self.timeout_s = timeout_s
        self.call = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )(metadata=metadata)
        self.pending: dict[str, asyncio.Future[None]] = {}
        self.writing = asyncio.Lock()  # grpc.aio takes one write at a time per stream
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        import grpc

        why = "the stream ended"
        try:
            async for response in self.call:
                future = self.pending.pop(response.infer_response.id, None)
                if future is None and self.pending:  # no id in the reply: the oldest request
                    future = self.pending.pop(next(iter(self.pending)))
                if future is not None and not future.done():
                    if response.error_message:
                        future.set_exception(RequestError(f"gRPC stream: {response.error_message}"))
                    else:
                        future.set_result(None)
        except grpc.aio.AioRpcError as exc:
            why = f"gRPC stream {exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            why = "the stream was closed"
            raise
        finally:
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(RequestError(why))
            self.pending.clear()

    async def infer(self, body: bytes, request_id: int) -> None:
        if self.reader.done():
            raise RequestError("gRPC stream: the stream is closed")
        key = str(request_id)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending[key] = future
        try:
            async with self.writing:
                await self.call.write(body + _id_field(request_id))
            await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"gRPC stream: no reply in {self.timeout_s:g} s") from None
        except RequestError:
            raise
        except Exception as exc:
            code, details = getattr(exc, "code", None), getattr(exc, "details", None)
            text = f"{code().name}: {details()}" if callable(code) and callable(details) else str(exc)
            raise RequestError(f"gRPC stream: {text}") from None
        finally:
            self.pending.pop(key, None)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.call.done_writing(), 2.0)
        try:
            await asyncio.wait_for(asyncio.shield(self.reader), 2.0)
        except (asyncio.TimeoutError, Exception):
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader
        self.call.cancel()


class GrpcStreamTransport(GrpcTransport):
    protocol = "grpc-stream"

    async def open(self, lanes: int, inflight_per_lane: int = 1) -> None:
        await super().open(lanes, inflight_per_lane)
        self.streams = [_Stream(ch, self.timeout_s, self.metadata) for ch in self.channels]
        self.next_id = 0

    async def infer(self, lane: int, index: int) -> None:
        self.next_id += 1
        await self.streams[lane].infer(self.bodies[index % len(self.bodies)], self.next_id)

    async def close(self) -> None:
        for stream in getattr(self, "streams", []):
            await stream.close()
        await super().close()


class ZmqTransport(Transport):
    """edgeserve's ZeroMQ client (asyncio), one socket per lane; inputs inline, or in a shm ring."""

    protocol = "zmq"
    shm = False

    async def open(self, lanes: int, inflight_per_lane: int = 1) -> None:
        from edgeserve.client import AsyncZmqClient

        self.clients = [
            AsyncZmqClient(self.url, timeout=self.timeout_s, copy_inputs=False) for _ in range(lanes)
        ]
        self.rings: list[Any] = []
        if self.shm:
            sizes = [len(_wire(a, self.datatypes[n])) for s in self.samples for n, a in s.items()]
            slot_size = max(max(sizes, default=1), 1)
            n_inputs = max(len(self.info.inputs), 1)
            fit = max(2, RING_BYTES_MAX // (slot_size * lanes))
            slots = min(max(2, inflight_per_lane * n_inputs + n_inputs), fit)
            for client in self.clients:
                self.rings.append(await client.create_ring(slots=slots, slot_size=slot_size))

    async def infer(self, lane: int, index: int) -> None:
        from edgeserve.client import ClientError

        sample = self.samples[index % len(self.samples)]
        client = self.clients[lane]
        inputs: dict[str, Any] = dict(sample)
        if self.shm:
            ring, taken = self.rings[lane], []
            try:
                for name, array in sample.items():  # the documented producer API: one copy in
                    slot = ring.acquire()
                    taken.append(slot)
                    inputs[name] = slot.write(array)
            except ClientError as exc:  # not sent: the slots are still ours
                for slot in taken:
                    slot.release()
                raise RequestError(f"ZeroMQ shm {exc.status}: {exc.message}") from None
        try:
            await client.infer(self.info.name, inputs, version=self.info.version)
        except ClientError as exc:
            raise RequestError(f"ZeroMQ {exc.status}: {exc.message}") from None

    async def close(self) -> None:
        for client in getattr(self, "clients", []):
            await client.close()  # also closes its rings


class ZmqShmTransport(ZmqTransport):
    protocol = "zmq-shm"
    shm = True


TRANSPORTS: dict[str, type[Transport]] = {
    t.protocol: t
    for t in (
        HttpTransport,
        HttpJsonTransport,
        GrpcTransport,
        GrpcStreamTransport,
        ZmqTransport,
        ZmqShmTransport,
    )
}
