"""The asyncio client's callback requests (`submit_now`, `submit_to`), as the camera pipeline uses
them: the reply goes to a callback inside the socket's reader, ring outputs as views read there, the
input slots already back and the output slots given back after; errors, timeouts, a failing callback
and closing all reach the callback once, and no slot is lost."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest
from zmq_harness import RunningFrontend, gate, sample, ungate

from edgeserve.client import AsyncZmqClient, ClientError

Replies = list[tuple[Any, ClientError | None]]


def _collector(replies: Replies, done: asyncio.Event, wanted: int, keep: Any = None) -> Any:
    def on_reply(result: Any, error: ClientError | None) -> None:
        replies.append((keep(result) if keep is not None and result is not None else result, error))
        if len(replies) >= wanted:
            done.set()

    return on_reply


def test_submit_now_hands_views_to_the_callback_with_the_inputs_already_back(server: RunningFrontend) -> None:
    async def main() -> None:
        async with AsyncZmqClient(server.endpoint, timeout=5.0) as client:
            # the reader is installed by the first request that waits: until then nothing goes at once
            assert not client.submit_ready()
            assert not client.submit_now(lambda r, e: None, "id_fp32", {"INPUT0": sample("FP32", (1, 4))})
            inputs = await client.create_ring(slots=1, slot_size=1024)  # one request at a time
            outputs = await client.create_ring(slots=4, slot_size=1024)
            assert client.submit_ready()

            seen: list[tuple[float, bool, int, int]] = []
            done = asyncio.Event()

            def on_reply(result: Any, error: ClientError | None) -> None:
                assert error is None
                out = result.as_numpy("OUTPUT0")
                # a view of the output slot (not a copy), the input slot already free, the output not yet
                seen.append((float(out[0, 0]), out.base is not None, inputs.free, outputs.free))
                if len(seen) == 20:
                    done.set()

            for i in range(20):
                while inputs.free == 0:
                    await asyncio.sleep(0.001)
                value = np.full((1, 4), i, np.float32)
                sent = client.submit_now(
                    on_reply, "id_fp32", {"INPUT0": inputs.acquire().write(value)}, {"OUTPUT0": outputs}
                )
                assert sent
            await asyncio.wait_for(done.wait(), 10)
            assert sorted(v for v, *_ in seen) == list(range(20))
            assert all(is_view for _, is_view, _, _ in seen)
            assert all(free_in == 1 and free_out == 3 for _, _, free_in, free_out in seen)
            assert inputs.free == 1 and outputs.free == 4

    asyncio.run(main())


def test_submit_to_waits_and_errors_reach_the_callback(server: RunningFrontend) -> None:
    async def main() -> None:
        async with AsyncZmqClient(server.endpoint, timeout=5.0) as client:
            replies: Replies = []
            done = asyncio.Event()
            on_reply = _collector(replies, done, 2, keep=lambda r: r.as_numpy("OUTPUT0").copy())
            await client.submit_to(on_reply, "id_int64", {"INPUT0": np.full((1, 3), 7, np.int64)})
            await client.submit_to(on_reply, "missing", {"INPUT0": np.zeros((1, 3), np.int64)})
            await asyncio.wait_for(done.wait(), 10)
            by_error = {e.status if e else None: r for r, e in replies}
            assert by_error[None].tolist() == [[7, 7, 7]]
            assert by_error["NOT_FOUND"] is None

    asyncio.run(main())


def test_a_failing_callback_does_not_stop_the_replies_behind_it(
    server: RunningFrontend, caplog: pytest.LogCaptureFixture
) -> None:
    """ZMQ_FD is edge-triggered: a callback that raised while replies were queued must not leave
    them unread."""

    async def main() -> None:
        async with AsyncZmqClient(server.endpoint, timeout=5.0) as client:
            await client.ping()
            good: list[int] = []
            done = asyncio.Event()

            def on_reply(result: Any, error: ClientError | None) -> None:
                value = int(result.as_numpy("OUTPUT0")[0, 0])
                if value % 2:
                    raise RuntimeError(f"callback bug on {value}")
                good.append(value)
                if len(good) == 10:
                    done.set()

            for i in range(20):
                assert client.submit_now(on_reply, "id_int64", {"INPUT0": np.full((1, 3), i, np.int64)})
            await asyncio.wait_for(done.wait(), 10)
            assert sorted(good) == list(range(0, 20, 2))

    with caplog.at_level(logging.ERROR, logger="edgeserve.client"):
        asyncio.run(main())
    assert sum("reply callback failed" in r.message for r in caplog.records) == 10


def test_timeout_and_close_reach_the_callback_once_and_keep_the_slots_safe(server: RunningFrontend) -> None:
    event = gate(server, "gated")
    try:

        async def main() -> None:
            client = AsyncZmqClient(server.endpoint, timeout=5.0)
            ring = await client.create_ring(slots=2, slot_size=256)
            replies: Replies = []
            done = asyncio.Event()
            on_reply = _collector(replies, done, 1)
            value = ring.acquire().write(np.ones((1, 4), np.float32))
            await client.submit_to(on_reply, "gated", {"INPUT0": value}, timeout=0.2)
            await asyncio.wait_for(done.wait(), 10)
            assert [e.status if e else None for _, e in replies] == ["DEADLINE_EXCEEDED"]
            # the server may still read the slot: quarantined, reused only when no other is free
            assert value.slot is not None and ring.acquire().index != value.slot.index
            await asyncio.sleep(0.3)
            assert len(replies) == 1  # never answered twice

            closing: Replies = []
            on_close = _collector(closing, asyncio.Event(), 1)
            assert client.submit_now(on_close, "gated", {"INPUT0": np.ones((1, 4), np.float32)})
            await client.close()
            assert [e.status if e else None for _, e in closing] == ["UNAVAILABLE"]

        asyncio.run(main())
    finally:
        ungate(server, "gated", event)
