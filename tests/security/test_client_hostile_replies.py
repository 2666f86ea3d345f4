"""A hostile or impostor server (whoever binds the endpoint a camera client connects to) against the
asyncio client's callback path, the one `edgeserve watch` uses: malformed, oversized, garbage and
replayed replies. Every request ends in exactly one call of its callback, with a clear error where
the reply is bad; no slot stays taken and the client keeps working."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from edgeserve.client import AsyncZmqClient, ClientError


def _out(desc: dict[str, Any]) -> dict[str, Any]:
    return {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 4], **desc}


# Each case: what the impostor sends for a request (its id and its output slot's ref) -> header frames.
Hostile = Callable[[int, dict[str, Any]], list[bytes]]


def _reply(header: dict[str, Any]) -> list[bytes]:
    return [json.dumps({"v": 1, **header}).encode()]


CASES: dict[str, tuple[Hostile, str | None]] = {
    "byte size not a number": (
        lambda i, ref: _reply(
            {"id": i, "status": "OK", "outputs": [_out({"shm": {**ref, "byte_size": "abc"}})]}
        ),
        "INTERNAL",
    ),
    "byte size past the slot": (
        lambda i, ref: _reply(
            {"id": i, "status": "OK", "outputs": [_out({"shm": {**ref, "byte_size": 10**12}})]}
        ),
        "INTERNAL",
    ),
    "shape that does not fit its bytes": (
        lambda i, ref: _reply(
            {"id": i, "status": "OK", "outputs": [_out({"shape": [10**9, 10**9], "shm": ref})]}
        ),
        "INTERNAL",
    ),
    "shape not a list of numbers": (
        lambda i, ref: _reply({"id": i, "status": "OK", "outputs": [_out({"shape": "ab", "shm": ref})]}),
        "INTERNAL",
    ),
    "outputs not a list": (lambda i, ref: _reply({"id": i, "status": "OK", "outputs": 5}), "INTERNAL"),
    "an error status with a terminal escape": (
        lambda i, ref: _reply({"id": i, "status": "\x1b[31mEVIL", "message": "x" * 100_000}),
        "\\x1b[31mEVIL",  # escaped, as it reaches logs and terminals
    ),
    "garbage instead of a header": (lambda i, ref: [b"\xff\x00not json"], "DEADLINE_EXCEEDED"),
    "a header that is not an object": (lambda i, ref: [b"[1, 2, 3]"], "DEADLINE_EXCEEDED"),
}


def _impostor(endpoint: str, hostile: Hostile, replay: bool, ready: threading.Event) -> threading.Thread:
    def serve() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.bind(endpoint)
        ready.set()
        try:
            while True:
                try:
                    ident, header, *_ = sock.recv_multipart()
                except zmq.Again:
                    return
                request = json.loads(header)
                if request.get("op") != "infer":  # ring registration, bye: acknowledged
                    sock.send_multipart(
                        [ident, json.dumps({"v": 1, "id": request["id"], "status": "OK"}).encode()]
                    )
                    if request.get("op") == "bye":
                        return
                    continue
                ref = request["outputs"][0]["shm"]
                frames = hostile(request["id"], ref)
                sock.send_multipart([ident, *frames])
                if replay:  # the same reply again, later: must not answer the request twice
                    sock.send_multipart([ident, *frames])
        finally:
            sock.close(linger=0)
            ctx.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _run(endpoint: str, timeout: float) -> tuple[list[tuple[Any, ClientError | None]], int, int]:
    async def main() -> tuple[list[tuple[Any, ClientError | None]], int, int]:
        client = AsyncZmqClient(endpoint, timeout=timeout)
        inputs = await client.create_ring(slots=1, slot_size=256)
        outputs = await client.create_ring(slots=1, slot_size=256)
        replies: list[tuple[Any, ClientError | None]] = []
        done = asyncio.Event()

        def on_reply(result: Any, error: ClientError | None) -> None:
            replies.append((result, error))
            done.set()

        value = inputs.acquire().write(np.ones((1, 4), np.float32))
        assert client.submit_now(on_reply, "m", {"INPUT0": value}, {"OUTPUT0": outputs})
        await asyncio.wait_for(done.wait(), timeout + 5)
        await asyncio.sleep(0.3)  # a replayed reply would land here
        free = (inputs.free, outputs.free)
        await client.close()
        return replies, *free

    return asyncio.run(main())


@pytest.mark.parametrize("replay", [False, True], ids=["once", "replayed"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_reply_ends_its_request_once_with_a_clear_error(
    case: str, replay: bool, tmp_path: Path
) -> None:
    hostile, status = CASES[case]
    endpoint = f"ipc://{tmp_path}/impostor.zmq"
    ready = threading.Event()
    impostor = _impostor(endpoint, hostile, replay, ready)
    assert ready.wait(5)
    replies, inputs_free, outputs_free = _run(endpoint, timeout=1.0)
    impostor.join(15)
    assert len(replies) == 1, replies  # exactly one answer, replayed or not
    result, error = replies[0]
    assert result is None and error is not None and error.status == status
    assert "\x1b" not in error.status + error.message and len(error.message) < 1100  # escaped, capped
    # every slot is back (a timed-out request's slots are quarantined: free, reused last)
    assert (inputs_free, outputs_free) == (1, 1)
