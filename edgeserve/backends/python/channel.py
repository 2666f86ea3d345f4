"""The event channel: messages either side starts, beside the call/reply control channel (wire.py).

Decoupled responses (sent from any model thread, also after execute returned), BLS calls (the worker
asks the server to run a model and waits while execute runs), `is_cancelled()` and custom-metric
updates are started by the worker; the server answers some of them. They travel on a second AF_UNIX
socketpair, so the execute call/reply path stays as it was (one poll, one read).

- Framing as wire.py: a uint32 length and compact JSON; only JSON crosses, the server never unpickles.
- A question carries `"q": n` (n chosen by the asker); its answers carry `"a": n`, and `"more": true`
  on all but the last (a decoupled BLS call gets several). A message without "q" needs no answer.
- One reader thread per side reads the socket and dispatches: answers to their waiters, the rest to
  the side's handler (in order: a request's responses are handled in the order they were sent).
- Tensors: one shared-memory file (a memfd) of 2 x HALF bytes, sparse until written. The worker
  allocates in the first half, the server in the second (`Arena`, first fit); a message names its
  tensors by offset as wire.py does, and the reader frees its peer's block by answering (a decoupled
  response is freed when the server's answer arrives, a BLS call's inputs when its final result does)
  or with a `{"op": "free"}` message (a decoupled BLS call's results, copied out), or by naming it in
  the `"free"` list of its next message (a BLS result the model holds as views into the server's half,
  `read_held`: freed once the model dropped every view; no message of its own on the call's path,
  and the server's next write for this worker comes after the next call, which carries it). A
  writer whose half is full waits for frees: with the synchronous answers, a model that sends 10^6
  responses to a slow reader holds at most HALF bytes and one message per sending thread.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from edgeserve.backends.python import wire
from edgeserve.protocol import datatypes

HALF = 64 << 20  # each side's tensor space; a larger BLS tensor or response is refused with the limit
ALLOC_WAIT_S = 60.0  # a full half frees as the peer reads; past this the peer is stuck
Answer = Callable[[wire.Header], None]


class ChannelClosed(ConnectionError):
    """The peer went away (or the channel was closed): pending questions end with this."""


class ArenaFull(Exception):
    """A block larger than the half, or no space freed in time."""


class ArenaBusy(ArenaFull):
    """No space freed in time (a block that fits the half)."""


class Arena:
    """First-fit blocks in [base, base + size); `alloc` waits while full (the backpressure)."""

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size
        self._used: dict[int, int] = {}  # offset -> end
        self._cond = threading.Condition()
        self._closed = False

    def alloc(self, nbytes: int, wait_s: float = ALLOC_WAIT_S) -> int:
        need = wire.align(max(1, nbytes))
        if need > self.size:
            raise ArenaFull(f"{nbytes} bytes: more than the {self.size >> 20} MiB a model may have in flight")
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise ChannelClosed("the channel closed")
                offset = self._fit(need)
                if offset is not None:
                    self._used[offset] = offset + need
                    return offset
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ArenaBusy(f"no space for {nbytes} bytes freed in {wait_s:g} s (the peer is stuck)")
                self._cond.wait(left)

    def _fit(self, need: int) -> int | None:
        cursor = self.base
        for start, end in sorted(self._used.items()):
            if start - cursor >= need:
                return cursor
            cursor = max(cursor, end)
        return cursor if self.base + self.size - cursor >= need else None

    def free(self, offset: int) -> None:
        with self._cond:
            if self._used.pop(offset, None) is not None:
                self._cond.notify_all()

    def in_use(self) -> int:
        with self._cond:
            return sum(end - start for start, end in self._used.items())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Channel:
    """One side of the event channel. `handler(message)` runs on the reader thread for each message
    that is not an answer; `on_close()` once when the peer goes."""

    def __init__(self, sock: Any, region: wire.Region, side: str, name: str) -> None:
        self.sock = sock
        self.region = region
        mine, theirs = (0, HALF) if side == "worker" else (HALF, 0)
        self.arena = Arena(mine, HALF)
        self.peer_base = theirs
        self.name = name
        self.handler: Callable[[wire.Header], None] = lambda message: None
        self.on_close: Callable[[], None] = lambda: None
        self._send_lock = threading.Lock()
        self._pending: dict[int, Answer] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self.closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._frees: deque[int] = deque()  # the peer's blocks to free with my next message

    def on_reader(self) -> bool:
        """Whether the calling thread is this side's reader (it must not wait for the peer's frees)."""
        thread = self._thread
        return thread is not None and thread.ident == threading.get_ident()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._read, name=f"edgeserve-events-{self.name}", daemon=True)
        self._thread.start()

    # -- sending ------------------------------------------------------------------------------------
    def post(self, message: wire.Header) -> None:
        """A message that needs no answer (or an answer: it carries "a")."""
        if self.closed.is_set():
            raise ChannelClosed("the channel closed")
        try:
            with self._send_lock:
                if self._frees:
                    frees = []
                    while self._frees:
                        frees.append(self._frees.popleft())
                    message = {**message, "free": frees}
                wire.send(self.sock, message)
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None

    def ask(self, message: wire.Header, on_answer: Answer) -> int:
        """Send a question; `on_answer(answer)` runs on the reader thread for each answer (and once
        with `{"closed": True}` if the channel closes first)."""
        number = next(self._ids)
        with self._pending_lock:
            if self.closed.is_set():
                raise ChannelClosed("the channel closed")
            self._pending[number] = on_answer
        try:
            self.post({**message, "q": number})
        except ChannelClosed:
            self.forget(number)
            raise
        return number

    def call(self, message: wire.Header, timeout_s: float | None = None) -> wire.Header:
        """Ask and wait for the one answer."""
        done = threading.Event()
        box: list[wire.Header] = []

        def answered(answer: wire.Header) -> None:
            box.append(answer)
            done.set()

        number = self.ask(message, answered)
        if not done.wait(timeout_s):
            self.forget(number)
            raise ChannelClosed("no answer in time")
        if box[0].get("closed"):
            raise ChannelClosed("the channel closed")
        return box[0]

    def answer(self, question: wire.Header, reply: wire.Header, more: bool = False) -> None:
        if "q" not in question:
            return
        message = {**reply, "a": question["q"]}
        if more:
            message["more"] = True
        self.post(message)

    def forget(self, number: int) -> None:
        with self._pending_lock:
            self._pending.pop(number, None)

    # -- tensors -------------------------------------------------------------------------------------
    def write(
        self, tensors: list[tuple[str, wire.Array]], wait_s: float = ALLOC_WAIT_S
    ) -> tuple[list[wire.Header], int | None]:
        """Tensors into a block of my half: their descriptors and the block (None: no tensors)."""
        if not tensors:
            return [], None
        prepared, size = wire.prepare_tensors(tensors)
        offset = self.arena.alloc(size, wait_s)
        try:
            return wire.write_prepared(self.region.buffer, prepared, offset), offset
        except BaseException:
            self.arena.free(offset)
            raise

    def read(self, headers: list[wire.Header], copy: bool) -> dict[str, wire.Array]:
        """The peer's tensors (inside its half: a header pointing elsewhere is refused)."""
        out = {}
        for header in headers:
            offset, nbytes = int(header["o"]), int(header["b"])
            if offset < self.peer_base or offset + nbytes > self.peer_base + HALF:
                raise ValueError(f"tensor '{header.get('n')}' lies outside the peer's shared memory")
            out[str(header["n"])] = wire.read_tensor(self.region, header, copy)
        return out

    def release(self, block: int) -> None:
        """Free the peer's `block` with my next message (any thread, also a finalizer: no lock)."""
        self._frees.append(block)

    def read_held(self, headers: list[wire.Header], block: int) -> dict[str, wire.Array]:
        """The peer's tensors in its `block` as views (no copy); the block goes back to the peer
        (`release`) once every view is gone. BYTES tensors are decoded into copies."""
        start = int(block)
        spans = [(int(h["o"]), int(h["b"])) for h in headers]
        end = max((o + b for o, b in spans), default=start)
        if start < self.peer_base or end > self.peer_base + HALF or any(o < start or b < 0 for o, b in spans):
            raise ValueError("a tensor lies outside the peer's block")
        holder: wire.Array = np.ndarray((end - start,), np.uint8, buffer=self.region.buffer, offset=start)
        whole = memoryview(holder.data)  # every view below keeps `holder`, and so the block, alive
        out = {}
        for h, (o, b) in zip(headers, spans, strict=True):
            shape = tuple(int(d) for d in h["s"])
            view = whole[o - start : o - start + b]
            out[str(h["n"])] = datatypes.from_buffer(view, str(h["t"]), shape, f"tensor '{h['n']}'")
        weakref.finalize(holder, self.release, start)
        return out

    # -- reading -------------------------------------------------------------------------------------
    def _read(self) -> None:
        reader = _Reader(self.sock)
        try:
            while True:
                message = reader.next()
                frees = message.pop("free", None)
                if isinstance(frees, list):
                    for block in frees:
                        if isinstance(block, int):
                            self.arena.free(block)
                number = message.get("a")
                if number is None:
                    self.handler(message)
                    continue
                with self._pending_lock:
                    callback = self._pending.get(int(number))
                    if callback is not None and not message.get("more"):
                        del self._pending[int(number)]
                if callback is not None:
                    callback(message)
        except (wire.PeerGone, OSError, ValueError):
            pass
        finally:
            self._shut()

    def _shut(self) -> None:
        with self._pending_lock:
            self.closed.set()
            pending, self._pending = self._pending, {}
        self.arena.close()
        for callback in pending.values():
            callback({"closed": True})
        self.on_close()

    def close(self) -> None:
        """Stop (the reader thread sees the socket end and fails what is pending)."""
        import socket

        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self._thread is None:
            self._shut()


class _Reader:
    """Messages from a stream where several may arrive in one read (many senders, unlike the control
    channel's strict call/reply, which wire.recv reads one at a time)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def _fill(self, count: int) -> None:
        while len(self.buffer) < count:
            chunk = self.sock.recv(max(1 << 16, count - len(self.buffer)))
            if not chunk:
                raise wire.PeerGone("the event channel closed")
            self.buffer += chunk

    def next(self) -> wire.Header:
        self._fill(4)
        length = int.from_bytes(self.buffer[:4], "little")
        if length > wire.MAX_MESSAGE:
            raise wire.PeerGone(f"an event message of {length} bytes (broken peer)")
        self._fill(4 + length)
        body = bytes(self.buffer[4 : 4 + length])
        del self.buffer[: 4 + length]
        message = json.loads(body)
        if not isinstance(message, dict):
            raise ValueError("an event message that is not a JSON object")
        return message
