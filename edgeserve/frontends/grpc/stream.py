"""ModelStreamInfer: many requests in flight on one bidirectional stream, answered in completion order.

One reader task takes requests off the stream and submits each to the data plane (no task per
request: the data plane calls back from its worker thread); the handler coroutine is the only
writer. At most `max_inflight` requests of a stream are queued or running: past that the reader
stops reading, so HTTP/2 flow control pushes back on the client.

A per-request error is sent as `error_message` and the stream stays open, unless the client opened
it with `triton_grpc_error: true` metadata: then the first error ends the stream with its status.
Half-close: the handler finishes once every submitted request is answered. Cancel (or the server
stopping): the reader is cancelled; requests still running finish in the scheduler and their
answers are dropped with the stream's queue.

Decoupled models (Triton's `model_transaction_policy { decoupled: true }`): a request gets 0..N
responses, in order, each with `triton_final_response`; a final flag without a response is sent as an
empty response only when the request set `triton_enable_empty_final_response`. Their responses come
from the data plane's bounded ResponseStream: the handler takes them as it writes, so a client that
reads slowly slows the model (HTTP/2 flow control, then the stream's bound), never the server's memory.
When the stream ends (cancel, client gone, server stopping), each live request is cancelled: its model
sees `cancelled`.

Idle: a stream with nothing in flight that sends nothing for `idle_timeout_s` is ended with
DEADLINE_EXCEEDED (0 = never), so idle streams cannot pile up against `max_concurrent_rpcs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from edgeserve.frontends.access import INFERENCE
from edgeserve.frontends.grpc import codec, wire
from edgeserve.frontends.grpc.auth import AccessPolicy, check
from edgeserve.frontends.grpc.servicer import grpc_code, peer_client, shm_client
from edgeserve.protocol.errors import InferenceError, internal
from edgeserve.protocol.inference import InferResponse
from edgeserve.scheduling.job import client_scope
from edgeserve.server.dataplane import on_loop

if TYPE_CHECKING:
    from edgeserve.server.dataplane import DataPlane
    from edgeserve.server.streaming import ResponseStream

log = logging.getLogger("edgeserve.grpc")

Context: TypeAlias = Any  # grpc.aio.ServicerContext (grpcio ships no type hints)

_EMPTY_FINAL = "triton_enable_empty_final_response"
_READER_DONE = object()
_IDLE = object()


class _Meta:
    """What an error answer needs to name its request."""

    __slots__ = ("empty_final", "id", "model_name", "model_version")

    def __init__(self, request_id: str = "", model_name: str = "", model_version: str = "") -> None:
        self.id = request_id
        self.model_name = model_name
        self.model_version = model_version
        self.empty_final = False  # triton_enable_empty_final_response (decoupled models)


def grpc_error_mode(context: Context) -> bool:
    for item in context.invocation_metadata() or ():
        if item[0] == "triton_grpc_error":
            value = item[1].decode() if isinstance(item[1], bytes) else str(item[1])
            return value.strip().lower() == "true"
    return False


class StreamHandler:
    def __init__(self, dataplane: DataPlane, policy: AccessPolicy, max_message_bytes: int,
                 max_inflight: int = 1024, *, idle_timeout_s: float = 0.0) -> None:  # fmt: skip
        self.dataplane = dataplane
        self.idle_timeout_s = idle_timeout_s
        self.policy = policy
        self.max_message_bytes = max_message_bytes
        self.max_inflight = max_inflight
        self.open_streams = 0  # for tests and stats
        self.inline_max_ns = 0  # set by the frontend ([grpc] inline_max_us)
        self.local_port = 0  # the bound port, set by the frontend (as the servicer's)

    async def handle(self, request_iterator: Any, context: Context) -> None:
        try:
            check(self.policy, context, INFERENCE)
        except InferenceError as exc:
            await context.abort(grpc_code(exc), exc.message)
        self.open_streams += 1
        try:
            with client_scope(peer_client(context)):  # the reader task copies this context
                await self._serve(request_iterator, context, grpc_error_mode(context))
        finally:
            self.open_streams -= 1

    async def _serve(self, request_iterator: Any, context: Context, abort_on_error: bool) -> None:
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[Any] = asyncio.Queue()
        slots = asyncio.Semaphore(self.max_inflight)
        state = {"inflight": 0}
        client = shm_client(context, self.local_port)  # one connection: one lookup per stream

        def deliver(meta: _Meta, result: InferResponse | InferenceError) -> None:
            answers.put_nowait((meta, result))

        live: set[ResponseStream] = set()  # decoupled requests whose final response is not written

        def make_notify(meta: _Meta) -> Any:
            wake = on_loop(loop, answers.put_nowait)

            def notify(stream: ResponseStream) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads
                    wake((meta, stream))

            return notify

        def make_callback(meta: _Meta) -> Any:
            def answer(result: InferResponse | InferenceError) -> None:
                deliver(meta, result)

            deliver_here = on_loop(loop, answer)

            def on_done(result: InferResponse | InferenceError) -> None:
                # RuntimeError: the loop is closed, the server is gone and nobody waits for an answer
                with contextlib.suppress(RuntimeError):
                    deliver_here(result)

            return on_done

        async def reader() -> None:
            try:
                async for message in request_iterator:
                    activity[0] = loop.time()
                    await slots.acquire()
                    state["inflight"] += 1
                    if isinstance(message, wire.Malformed):
                        deliver(_Meta(), internal(message.message))
                        continue
                    msg = message.message
                    meta = _Meta(msg.id, msg.model_name, msg.model_version)
                    try:
                        # per message: refused at once when the server or the model's queue is full
                        self.dataplane.admit(msg.model_name, msg.model_version)
                    except InferenceError as exc:
                        deliver(meta, exc)
                        continue
                    try:
                        request = codec.to_infer_request(message)
                    except InferenceError as exc:
                        self.dataplane.release()
                        deliver(meta, exc)
                        continue
                    except Exception as exc:
                        self.dataplane.release()
                        log.exception("decoding stream request %s failed", msg.id)
                        deliver(meta, internal(f"internal error decoding the request: {exc}"))
                        continue
                    request.shm_client = client
                    try:
                        if self._decoupled(msg.model_name, msg.model_version):
                            meta.empty_final = bool(request.parameters.get(_EMPTY_FINAL))
                            live.add(self.dataplane.submit_stream(request, make_notify(meta), admitted=True))
                            continue
                        self.dataplane.submit(
                            request, make_callback(meta), admitted=True, inline_max_ns=self.inline_max_ns
                        )
                    except Exception as exc:  # submit answers through the callback; this is a bug path
                        log.exception("submitting stream request %s failed", msg.id)
                        deliver(meta, internal(f"internal error submitting the request: {exc}"))
            finally:
                answers.put_nowait(_READER_DONE)

        activity = [loop.time()]
        timer: list[asyncio.TimerHandle | None] = [None]
        idle_s = self.idle_timeout_s

        def check_idle() -> None:
            now = loop.time()
            if state["inflight"]:
                activity[0] = now
            elif now - activity[0] >= idle_s:
                answers.put_nowait(_IDLE)
                return
            timer[0] = loop.call_at(activity[0] + idle_s, check_idle)

        if idle_s > 0:
            timer[0] = loop.call_later(idle_s, check_idle)
        reader_task = asyncio.create_task(reader(), name="grpc-stream-reader")
        reader_done = False
        try:
            while not (reader_done and state["inflight"] == 0):
                item = await answers.get()
                if item is _READER_DONE:
                    reader_done = True
                    continue
                if item is _IDLE:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"stream idle for {self.idle_timeout_s:g} s ([grpc] stream_idle_timeout_s); closed",
                    )
                meta, result = item
                if not isinstance(result, (InferResponse, InferenceError)):  # a decoupled request's stream
                    payloads, ended = self._stream_payloads(meta, result)
                    for payload in payloads:
                        if isinstance(payload, InferenceError):  # the request's error, ended it
                            if abort_on_error:
                                await context.abort(grpc_code(payload), payload.message)
                            payload = codec.encode_stream_error(
                                payload, meta.id, meta.model_name, meta.model_version
                            )
                        await context.write(payload)
                    if ended and result in live:
                        live.discard(result)
                        state["inflight"] -= 1
                        slots.release()
                    continue
                state["inflight"] -= 1
                slots.release()
                payload = self._encode(meta, result)
                if isinstance(payload, InferenceError):
                    if abort_on_error:
                        await context.abort(grpc_code(payload), payload.message)
                    payload = codec.encode_stream_error(payload, meta.id, meta.model_name, meta.model_version)
                await context.write(payload)
        finally:
            for stream in live:  # the client went away or the stream ended: the models see cancelled
                stream.cancel()
            if timer[0] is not None:
                timer[0].cancel()
            if not reader_task.done():
                reader_task.cancel()
            try:
                await reader_task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # the client went away mid-read, typically
                log.debug("stream reader ended: %r", exc)

    def _decoupled(self, name: str, version: str) -> bool:
        try:
            return bool(self.dataplane.model_config(name, version).model_transaction_policy.decoupled)
        except InferenceError:
            return False  # unknown or loading: the unary path answers why

    def _stream_payloads(
        self, meta: _Meta, stream: ResponseStream
    ) -> tuple[list[bytes | InferenceError], bool]:
        """What to write for the responses a decoupled request's stream holds now, in order, and
        whether its final one is among them."""
        payloads: list[bytes | InferenceError] = []
        ended = False
        for result, final in stream.take():
            ended = ended or final
            if result is None:  # the final flag alone
                if meta.empty_final:
                    empty = InferResponse(meta.model_name, meta.model_version, meta.id)
                    payloads.append(codec.encode_stream_response(empty, self.max_message_bytes, True))
                continue
            if isinstance(result, InferenceError):
                if final:
                    payloads.append(result)
                else:  # an error response, more follow
                    payloads.append(codec.encode_stream_error(
                        result, meta.id, meta.model_name, meta.model_version, final=False
                    ))  # fmt: skip
                continue
            try:
                payloads.append(codec.encode_stream_response(result, self.max_message_bytes, final))
            except InferenceError as exc:
                payloads.append(codec.encode_stream_error(
                    exc, meta.id, meta.model_name, meta.model_version, final=final
                ))  # fmt: skip
        return payloads, ended

    def _encode(self, meta: _Meta, result: InferResponse | InferenceError) -> bytes | InferenceError:
        if isinstance(result, InferenceError):
            return result
        try:
            return codec.encode_stream_response(result, self.max_message_bytes)
        except InferenceError as exc:
            return exc
        except Exception as exc:
            log.exception("encoding the stream response of request %s failed", meta.id)
            return internal(f"internal error encoding the response: {exc}")
