"""pb_utils' requests inside the worker: InferenceRequest (as execute() gets it, and as a BLS call:
`exec()`, `exec(decoupled=True)`, `await async_exec()`), InferenceResponseSender (decoupled models).

Both talk to the server over the member's event channel (channel.py). Which channel: the one of the
model whose code is running (a context variable the worker sets around initialize/execute/finalize,
copied into asyncio tasks); a thread the model started itself has no context, so it gets the
process's only channel (a worker of its own), or in a python_worker_group an error that says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from edgeserve.backends.python import callref, wire
from edgeserve.backends.python import pb_core as pb_utils
from edgeserve.backends.python.callref import CallRegion
from edgeserve.backends.python.channel import ArenaFull, Channel, ChannelClosed
from edgeserve.protocol import datatypes

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
_NAMES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
          "ALREADY_EXISTS", "CANCELLED")  # fmt: skip
_CODES = {name: code for code, name in enumerate(_NAMES)}


@dataclass
class Link:
    """One model's way to the server: its event channel, its name and the BLS chain it runs under."""

    channel: Channel
    model: str
    chain: str = ""
    model_dir: str = ""
    call_region: CallRegion | None = None  # inputs passed on by reference (callref.py)


current: contextvars.ContextVar[Link | None] = contextvars.ContextVar("edgeserve_link", default=None)
_links: list[Link] = []  # every member's link in this process


def register(link: Link) -> None:
    _links.append(link)


def find_link() -> Link | None:
    """The running model's link; None when it cannot be told (a model's own thread in a group)."""
    link = current.get()
    if link is None and len(_links) == 1:
        link = _links[0]
    return link


def _link() -> Link:
    link = find_link()
    if link is not None:
        return link
    raise pb_utils.TritonModelException(
        "a BLS call from a thread the model started, in a python_worker_group: call it from "
        "initialize/execute, or give the model a worker of its own"
    )


def _error_of(answer: wire.Header) -> pb_utils.TritonError:
    code = _CODES.get(str(answer.get("status", "INTERNAL")), pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(str(answer.get("error", "the server went away")), code)


class InferenceRequest:
    """A request: one of execute()'s (from the server), or a BLS call the model builds."""

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[pb_utils.Tensor] = (),
        requested_output_names: Sequence[str] = (),
        model_name: str | bytes = "",
        model_version: int | str = -1,
        flags: int = 0,
        timeout: int = 0,
        parameters: str | dict[str, Any] = "{}",
        **unsupported: Any,
    ) -> None:
        for name in unsupported:
            if name not in ("preferred_memory", "trace"):  # GPU memory hints and tracing: no-ops on CPU
                raise TypeError(f"InferenceRequest() got an unexpected keyword argument '{name}'")
        self._id = request_id
        self._correlation_id = correlation_id
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        # bytes as Triton takes them (its string inputs arrive as bytes: the bls example passes one on)
        self._model_name = model_name.decode() if isinstance(model_name, bytes) else model_name
        self._model_version = "" if model_version in (-1, "-1", "") else str(model_version)
        self._flags = int(flags)
        self._timeout = int(timeout)
        if isinstance(parameters, dict):
            parameters = json.dumps(parameters)
        self._parameters = parameters
        self._sender: InferenceResponseSender | None = None

    def inputs(self) -> list[pb_utils.Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def request_id(self) -> str:
        return self._id

    def parameters(self) -> str:
        return self._parameters

    def correlation_id(self) -> int | str:
        """The sequence's ID (0 outside a sequence and in a Direct batch's empty slot)."""
        return self._correlation_id

    def flags(self) -> int:
        """Triton's sequence flags: 1 = START, 2 = END (both on a one-request sequence)."""
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def model_name(self) -> str:
        return self._model_name

    def set_release_flags(self, flags: int) -> None:
        raise pb_utils.TritonModelException(
            "request rescheduling (set_release_flags) needs iterative sequence batching (not in edgeserve)"
        )

    # -- decoupled ------------------------------------------------------------------------------------
    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise pb_utils.TritonModelException(
                "get_response_sender() is for decoupled models (model_transaction_policy { decoupled: true })"
            )
        return self._sender

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled() if self._sender is not None else False

    # -- BLS ------------------------------------------------------------------------------------------
    def _message(self, link: Link, decoupled: bool) -> tuple[wire.Header, int | None]:
        if not self._model_name:
            raise pb_utils.TritonModelException("a BLS InferenceRequest needs model_name")
        try:
            parameters = json.loads(self._parameters or "{}")
        except ValueError:
            raise pb_utils.TritonModelException("InferenceRequest parameters must be a JSON object") from None
        if not isinstance(parameters, dict):
            raise pb_utils.TritonModelException("InferenceRequest parameters must be a JSON object")
        references, copies = self._references(link, decoupled)
        try:
            headers, block = link.channel.write(copies)
        except (ArenaFull, ValueError, TypeError) as exc:
            self._unpin(link, references)
            raise pb_utils.TritonModelException(f"cannot send the BLS inputs: {exc}") from None
        message = {"op": "bls", "model": self._model_name, "version": self._model_version, "id": self._id,
                   "corrid": self._correlation_id, "flags": self._flags, "timeout_us": self._timeout,
                   "params": parameters, "outputs": self._requested, "inputs": references + headers,
                   "decoupled": decoupled, "chain": link.chain}  # fmt: skip
        return message, block

    def _references(
        self, link: Link, decoupled: bool
    ) -> tuple[list[wire.Header], list[tuple[str, wire.Array]]]:
        """Inputs still in the per-call region, named by reference (pinned); the others, to copy."""
        references: list[wire.Header] = []
        copies = []
        for tensor in self._inputs:
            array = tensor.as_numpy()
            span = None if decoupled or link.call_region is None else link.call_region.pin(array)
            if span is None:
                copies.append((tensor.name(), array))
                continue
            datatype = datatypes.from_numpy(array.dtype)
            references.append({"n": tensor.name(), "t": datatype, "s": list(array.shape), "o": span[0],
                               "b": span[1], "r": callref.CALL})  # fmt: skip
        return references, copies

    @staticmethod
    def _unpin(link: Link, references: list[wire.Header]) -> None:
        for _ in references:
            assert link.call_region is not None
            link.call_region.unpin()

    def _start(self, decoupled: bool, deliver: Any) -> None:
        """Ask the server; `deliver(response, final)` runs on the reader thread for each result."""
        link = _link()
        message, block = self._message(link, decoupled)
        channel = link.channel
        references = [h for h in message["inputs"] if "r" in h]
        settled = threading.Lock()  # once: a channel closing under `ask` may also answer it

        def release() -> None:
            if settled.acquire(blocking=False):
                if block is not None:
                    channel.arena.free(block)
                self._unpin(link, references)  # the server is done with the per-call region

        def answered(answer: wire.Header) -> None:
            final = not answer.get("more")
            if final:
                release()
            deliver(_response(channel, answer, held=final and not decoupled), final)

        try:
            channel.ask(message, answered)
        except ChannelClosed:
            release()
            deliver(pb_utils.InferenceResponse(error=_error_of({})), True)

    def exec(self, decoupled: bool = False) -> Any:
        """Run the request on the model it names and wait: its InferenceResponse, or with `decoupled`
        an iterator of them that ends after the final one (flag only: an empty response)."""
        if decoupled:
            results: queue.SimpleQueue[tuple[pb_utils.InferenceResponse, bool]] = queue.SimpleQueue()
            self._start(True, lambda response, final: results.put((response, final)))
            return _iterate(results)
        done = threading.Event()
        box: list[pb_utils.InferenceResponse] = []

        def deliver(response: pb_utils.InferenceResponse, final: bool) -> None:
            if final:
                box.append(response)
                done.set()

        self._start(False, deliver)
        done.wait()
        return box[0]

    async def async_exec(self, decoupled: bool = False) -> Any:
        """`exec` for `async def execute`: awaits without blocking the worker's event loop."""
        import asyncio

        loop = asyncio.get_running_loop()
        if decoupled:
            # As Triton: the await ends at the first response and gives an iterator that a plain `for`
            # walks (Triton's bls_decoupled example); `async for` also works, without blocking the loop.
            results = _Responses()
            first: asyncio.Future[None] = loop.create_future()

            def arrived(response: pb_utils.InferenceResponse, final: bool) -> None:
                results.put(response, final)
                loop.call_soon_threadsafe(lambda: None if first.done() else first.set_result(None))

            self._start(True, arrived)
            await first
            return results
        future: asyncio.Future[pb_utils.InferenceResponse] = loop.create_future()

        def settle(response: pb_utils.InferenceResponse) -> None:
            if not future.done():
                future.set_result(response)

        def deliver(response: pb_utils.InferenceResponse, final: bool) -> None:
            if final:
                loop.call_soon_threadsafe(settle, response)

        self._start(False, deliver)
        return await future


def _response(channel: Channel, answer: wire.Header, held: bool) -> pb_utils.InferenceResponse:
    """An answer as the model sees it. `held` (a call's one answer): its tensors are views into the
    server's half, freed once the model dropped them (no copy, no message now); otherwise (a decoupled
    call's responses, which may come faster than the model drops them) copied out and freed at once."""
    if answer.get("closed") or "error" in answer:
        return pb_utils.InferenceResponse(error=_error_of(answer))
    headers = answer.get("outputs") or []
    block = answer.get("block")
    try:
        if held and isinstance(block, int):
            tensors = channel.read_held(headers, block)
            block = None  # the views own it now
        else:
            tensors = channel.read(headers, copy=True)
    except (ValueError, KeyError, TypeError) as exc:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"a bad BLS result: {exc}"))
    finally:
        if block is not None:
            with contextlib.suppress(ChannelClosed):
                channel.post({"op": "free", "o": block})
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in tensors.items()])


def _iterate(results: queue.SimpleQueue[tuple[pb_utils.InferenceResponse, bool]]) -> Iterator[Any]:
    while True:
        response, final = results.get()
        yield response
        if final:
            return


class _Responses:
    """A decoupled BLS call's responses, filled by the reader thread: `for` blocks for the next one,
    `async for` waits in an executor thread; both end after the final one."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[pb_utils.InferenceResponse, bool]] = queue.SimpleQueue()
        self._ended = False

    def put(self, response: pb_utils.InferenceResponse, final: bool) -> None:
        self._queue.put((response, final))

    def _take(self, item: tuple[pb_utils.InferenceResponse, bool]) -> pb_utils.InferenceResponse:
        self._ended = item[1]
        return item[0]

    def __iter__(self) -> _Responses:
        return self

    def __next__(self) -> pb_utils.InferenceResponse:
        if self._ended:
            raise StopIteration
        return self._take(self._queue.get())

    def __aiter__(self) -> _Responses:
        return self

    async def __anext__(self) -> pb_utils.InferenceResponse:
        import asyncio

        if self._ended:
            raise StopAsyncIteration
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            item = await asyncio.get_running_loop().run_in_executor(None, self._queue.get)
        return self._take(item)


class InferenceResponseSender:
    """A decoupled request's responses: `send(response, flags)` from any thread, any time, the final
    flag once. Each send waits until the server took the response (backpressure)."""

    def __init__(self, link: Link, rid: int) -> None:
        self._link = link
        self._rid = rid
        self._closed = False
        self._cancelled = False
        self._fresh = False
        self._lock = threading.Lock()

    def send(self, response: pb_utils.InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self._lock:
            if self._closed:
                text = "Unable to send response. Response sender has been closed."
                pb_utils.Logger.log_error(f"model '{self._link.model}': {text}")
                raise pb_utils.TritonModelException(text)
            if response is None and not final:
                raise pb_utils.TritonModelException("send() needs a response, or the final flag")
            self._closed = final
        channel = self._link.channel
        message: wire.Header = {"op": "resp", "r": self._rid, "final": final}
        block = None
        if response is not None:
            error = response.error()
            if error is not None:
                message["error"] = error.message() if isinstance(error, pb_utils.TritonError) else str(error)
                code = error.code() if isinstance(error, pb_utils.TritonError) else 1
                message["status"] = next((n for n, c in _CODES.items() if c == code), "INTERNAL")
            else:
                pairs = [(t.name(), t.as_numpy()) for t in response.output_tensors()]
                try:
                    message["outputs"], block = channel.write(pairs)
                except ArenaFull as exc:
                    raise pb_utils.TritonModelException(f"cannot send the response: {exc}") from None
        try:
            answer = channel.call(message)
        except ChannelClosed:
            self._cancelled = True
            return
        finally:
            if block is not None:
                channel.arena.free(block)
        self._cancelled = bool(answer.get("cancelled"))
        self._fresh = True

    def is_cancelled(self) -> bool:
        # The server said with its answer to the last send: a loop of send + is_cancelled asks once.
        fresh, self._fresh = self._fresh, False
        if self._cancelled or self._closed or fresh:
            return self._cancelled
        try:
            answer = self._link.channel.call({"op": "cancelled", "r": self._rid})
        except ChannelClosed:
            return True
        self._cancelled = bool(answer.get("cancelled"))
        return self._cancelled
