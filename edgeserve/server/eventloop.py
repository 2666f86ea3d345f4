"""The server's event loop. uvloop (libuv, in C) runs the frontends' callbacks and socket wake-ups
for less CPU than asyncio's pure-Python loop: on a 2-core box, 3-5% more unary gRPC requests/s
with a tiny model (benchmarks/bench_ab.py). Everything also runs on asyncio's loop, the fallback."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class EventLoopError(Exception):
    """`event_loop = "uvloop"` asked for, and uvloop cannot be imported."""


def chosen_loop(setting: str) -> str:
    """The loop to run for `[server] event_loop` (auto, uvloop, asyncio): "uvloop" or "asyncio"."""
    if setting == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError as exc:
        if setting == "uvloop":
            raise EventLoopError(
                f"server.event_loop = 'uvloop' but uvloop cannot be imported ({exc}); "
                "pip install uvloop, or set event_loop = 'auto'"
            ) from exc
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, None], loop: str) -> None:
    """Run `main` to completion on a new loop of the kind `chosen_loop` returned."""
    if loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)
