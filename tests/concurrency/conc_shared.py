"""Wires shared by many client threads at once: one asyncio client (one connection or pool) on one
event loop thread, with every client thread's calls running on it as concurrent coroutines, so the
answers of many callers come back over the same connection and must be matched to the right caller.

- grpc_aio: tritonclient.grpc.aio (one HTTP/2 channel, many concurrent unary calls);
- http_aio: tritonclient.http.aio (one aiohttp session and its connection pool);
- zmq_aio: edgeserve.client.AsyncZmqClient (one DEALER socket, replies matched by request id).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
from conc_transports import (
    REQUEST_TIMEOUT_S,
    Answer,
    Call,
    Endpoints,
    Transport,
    failure,
    grpc_answer,
    grpc_request,
    http_answer,
    http_request,
    sequence_kwargs,
)

from edgeserve.client import AsyncZmqClient, ClientError

T = TypeVar("T")


class _Hub:
    """One loop thread and one client, used by every transport of one wire and server."""

    def __init__(self, make: Callable[[], Awaitable[Any]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="conc-shared-loop", daemon=True)
        self.thread.start()
        self.users = 0
        self.client = self.call(make())

    def call(self, coroutine: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(REQUEST_TIMEOUT_S + 30)

    def close(self, closing: Awaitable[Any]) -> None:
        try:
            self.call(closing)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


_HUBS: dict[tuple[str, Endpoints], _Hub] = {}
_HUBS_LOCK = threading.Lock()


class SharedTransport(Transport):
    """A client thread's handle on its wire's shared client. Pipelined: the op's calls run as
    concurrent coroutines (ZeroMQ: sent in order, so a sequence's steps keep their order)."""

    def __init__(self, endpoints: Endpoints) -> None:
        super().__init__(endpoints)
        with _HUBS_LOCK:
            key = (self.name, endpoints)
            if key not in _HUBS:
                _HUBS[key] = _Hub(self._make)
            self.hub = _HUBS[key]
            self.hub.users += 1

    async def _make(self) -> Any:
        raise NotImplementedError

    async def _one(self, call: Call) -> Answer:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    def run(self, calls: Sequence[Call], pipelined: bool) -> list[Answer]:
        if pipelined:
            return self.hub.call(self._together(calls))
        return [self.hub.call(self._one(call)) for call in calls]

    async def _together(self, calls: Sequence[Call]) -> list[Answer]:
        return list(await asyncio.gather(*(self._one(call) for call in calls)))

    def close(self) -> None:
        with _HUBS_LOCK:
            self.hub.users -= 1
            if self.hub.users:
                return
            del _HUBS[(self.name, self.endpoints)]
        self.hub.close(self._close())


class _TritonAioTransport(SharedTransport):
    """tritonclient's asyncio clients: the same infer() and close(), a request and an answer of their own."""

    def _request(self, call: Call) -> dict[str, Any]:
        raise NotImplementedError

    def _answer(self, result: Any, names: Sequence[str]) -> Answer:
        raise NotImplementedError

    async def _one(self, call: Call) -> Answer:
        request = self._request(call)
        try:
            result = await self.hub.client.infer(**request)
        except Exception as exc:
            return failure(exc)
        return self._answer(result, call.outputs)

    async def _close(self) -> None:
        await self.hub.client.close()


class GrpcAioTransport(_TritonAioTransport):
    name = "grpc_aio"

    async def _make(self) -> Any:
        return grpcaio.InferenceServerClient(self.endpoints.grpc_url)

    def _request(self, call: Call) -> dict[str, Any]:
        return grpc_request(call)

    def _answer(self, result: Any, names: Sequence[str]) -> Answer:
        return grpc_answer(result, names)


class HttpAioTransport(_TritonAioTransport):
    name = "http_aio"

    async def _make(self) -> Any:
        return httpaio.InferenceServerClient(self.endpoints.http_url, conn_timeout=REQUEST_TIMEOUT_S)

    def _request(self, call: Call) -> dict[str, Any]:
        return http_request(call, httpaio)

    def _answer(self, result: Any, names: Sequence[str]) -> Answer:
        return http_answer(result, names)


class ZmqAioTransport(SharedTransport):
    name = "zmq_aio"

    async def _make(self) -> Any:
        return AsyncZmqClient(self.endpoints.zmq_endpoint, timeout=REQUEST_TIMEOUT_S)

    async def _submit(self, call: Call) -> Any:
        params = sequence_kwargs(call) or None
        try:
            return await self.hub.client.submit(
                call.model,
                call.inputs,
                call.outputs,
                version=call.version,
                parameters=params,
                timeout=call.timeout_s,
            )
        except ClientError as exc:
            return exc

    @staticmethod
    async def _wait(call: Call, future: Any) -> Answer:
        if isinstance(future, ClientError):
            return Answer(error=f"submit: {future!r}")
        try:
            result = await future
        except (ClientError, TimeoutError) as exc:
            lost = isinstance(exc, TimeoutError) or "timed out" in str(exc).lower()
            return Answer(error=f"{type(exc).__name__}: {exc}", lost=lost)
        return Answer(
            {n: np.array(result.as_numpy(n)) for n in call.outputs},
            model_version=str(result.model_version),
            wire_id=str(result.id),
        )

    async def _one(self, call: Call) -> Answer:
        return await self._wait(call, await self._submit(call))

    async def _together(self, calls: Sequence[Call]) -> list[Answer]:
        futures = [await self._submit(call) for call in calls]  # sent in order: a sequence stays ordered
        return list(await asyncio.gather(*(self._wait(c, f) for c, f in zip(calls, futures, strict=True))))

    async def _close(self) -> None:
        await self.hub.client.close()
