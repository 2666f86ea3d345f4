# mypy: disable-error-code="attr-defined"
# (pyproject's follow_imports=skip for zmq.* hides pyzmq's own types; see edgeserve/frontends/zmq/README.md)
"""ZeroMQ frontend: one ROUTER socket (ipc:// and tcp:// endpoints) on the server's event loop.

Many requests may be in flight per client (DEALER) socket, up to `zmq.max_inflight_per_client`.
Requests go to the one data plane with `DataPlane.submit`; its callback runs on a worker thread,
builds the reply frames there and hands them to the loop through an outbox drained by a single
`call_soon_threadsafe` per burst. Sends never block: a client whose queue is full loses that reply
(logged), a client that is gone is forgotten and its shared-memory regions are unregistered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import stat
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from edgeserve import __version__
from edgeserve.frontends.zmq import codec, wire
from edgeserve.protocol.errors import InferenceError, Status, internal, invalid_arg

if TYPE_CHECKING:
    from edgeserve.config import Settings
    from edgeserve.protocol.inference import InferResponse
    from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.zmq")

HEARTBEAT_IVL_MS = 2000  # ZMTP heartbeats find a dead TCP peer that never sent FIN
HEARTBEAT_TIMEOUT_MS = 6000
PROBE_DELAYS_S = (0.0, 0.2)  # check region owners right after a disconnect, and once more


class _Peer:
    __slots__ = ("envelope", "ident", "inflight", "owner", "owns_regions")

    def __init__(self, ident: bytes, envelope: list[bytes]) -> None:
        self.ident = ident
        self.envelope = envelope
        self.owner = "zmq:" + ident.hex()
        self.inflight = 0
        self.owns_regions = False


def _prepare_ipc(endpoint: str) -> str | None:
    """Create the socket's folder and remove a stale socket file; refuse one a live server holds."""
    path = endpoint[len("ipc://") :]
    if not path or path.startswith("@"):  # Linux abstract namespace: no file
        return None
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(
            f"zmq endpoint {endpoint}: {path} exists and is not a socket; remove it or pick another"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale zmq socket file %s", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    except OSError as exc:
        raise RuntimeError(f"zmq endpoint {endpoint}: cannot check {path}: {exc}") from None
    else:
        raise RuntimeError(f"zmq endpoint {endpoint} is in use by another running process")
    finally:
        probe.close()
    return path


class ZmqFrontend:
    name = "zmq"

    def __init__(self, dataplane: DataPlane, settings: Settings) -> None:
        self.dataplane = dataplane
        self.endpoints = list(settings.zmq.endpoints)
        self.max_inflight = max(1, settings.zmq.max_inflight_per_client)
        self.bound: list[str] = []  # resolved endpoints (tcp://...:* gets its port)
        self._ipc_paths: list[str] = []
        self._peers: dict[bytes, _Peer] = {}
        self._outbox: collections.deque[tuple[_Peer, list[Any]]] = collections.deque()
        self._wake_pending = False
        self._inflight = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._dropped = 0
        self._last_drop_log = 0.0

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> EHOSTUNREACH instead of a silent drop
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, max(1000, 2 * self.max_inflight))
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            for endpoint in self.endpoints:
                path = _prepare_ipc(endpoint) if endpoint.startswith("ipc://") else None
                try:
                    sock.bind(endpoint)
                except zmq.ZMQError as exc:
                    raise RuntimeError(f"zmq frontend cannot bind {endpoint}: {exc}") from None
                if path is not None:
                    self._ipc_paths.append(path)
                self.bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException:
            self._close_sockets()
            raise
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="zmq-recv"),
            asyncio.create_task(self._monitor_loop(), name="zmq-monitor"),
        ]
        log.info("zmq frontend listening on %s", ", ".join(self.bound))

    async def stop(self, grace_s: float) -> None:
        """Keep answering (the data plane refuses new work while shutting down) until in-flight
        requests are done or `grace_s` passes, then close."""
        deadline = time.monotonic() + max(0.0, grace_s)
        while self._inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._flush()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        for peer in list(self._peers.values()):
            if peer.owns_regions:
                self._release_regions(peer, "server stopping")
        self._peers.clear()
        self._close_sockets()
        log.info("zmq frontend stopped (%d request(s) still in flight)", self._inflight)

    def _close_sockets(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        for sock in (self._monitor, self._sock):
            if sock is not None:
                sock.close(linger=0)
        self._monitor = self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for path in self._ipc_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._ipc_paths = []

    # -- receive --------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            try:
                msg = await sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("zmq receive failed: %s", exc)
                continue
            try:
                self._handle(msg)
            except Exception:  # a bug here must not stop the frontend
                log.exception("zmq frontend failed to handle a message")

    def _handle(self, msg: list[Any]) -> None:
        ident = msg[0].bytes
        index = 1
        envelope = [ident]
        if len(msg) > 1 and len(msg[1]) == 0:  # a REQ socket's empty delimiter
            envelope.append(b"")
            index = 2
        if index >= len(msg):
            return
        peer = self._peers.get(ident)
        if peer is None:
            peer = self._peers[ident] = _Peer(ident, envelope)
        try:
            header = wire.loads(msg[index].buffer)
        except ValueError:
            self._reply(peer, codec.error_reply(None, invalid_arg("header frame is not valid JSON")))
            self._maybe_forget(peer)
            return
        req_id = header.get("id") if isinstance(header, dict) else None
        try:
            if not isinstance(header, dict):
                raise invalid_arg("header frame must be a JSON object")
            version = header.get("v")
            if version != wire.VERSION:
                raise InferenceError(
                    Status.UNSUPPORTED,
                    f"wire format version {version!r} is not supported; "
                    f"this server speaks version {wire.VERSION}",
                )
            op = header.get("op", wire.OP_INFER)
            if op == wire.OP_INFER:
                self._infer(peer, header, msg[index + 1 :])
                return
            self._control(peer, op, header)
        except InferenceError as exc:
            self._reply(peer, codec.error_reply(req_id, exc))
        except Exception as exc:
            log.exception("zmq request %r failed", req_id)
            self._reply(peer, codec.error_reply(req_id, internal(f"internal error: {exc}")))
        self._maybe_forget(peer)

    def _infer(self, peer: _Peer, header: dict[str, Any], frames: list[Any]) -> None:
        if peer.inflight >= self.max_inflight:
            raise InferenceError(
                Status.RESOURCE_EXHAUSTED,
                f"too many requests in flight from this client (max {self.max_inflight}); "
                "wait for replies before sending more",
            )
        decoded = codec.decode_infer(header, frames, self.dataplane.shm)
        peer.inflight += 1
        self._inflight += 1

        def on_done(result: InferResponse | InferenceError) -> None:
            try:
                if isinstance(result, InferenceError):
                    reply = codec.error_reply(decoded.req_id, result)
                else:
                    reply = codec.infer_reply(decoded, result)
            except InferenceError as exc:
                reply = codec.error_reply(decoded.req_id, exc)
            except Exception as exc:
                log.exception("building the zmq reply for request %r failed", decoded.req_id)
                reply = codec.error_reply(
                    decoded.req_id, internal(f"internal error building the reply: {exc}")
                )
            finally:
                decoded.release()
            self._post(peer, reply)

        self.dataplane.submit(decoded.request, on_done)

    # -- control messages -----------------------------------------------------------------------
    def _control(self, peer: _Peer, op: Any, header: dict[str, Any]) -> None:
        req_id = header.get("id")
        shm = self.dataplane.shm
        body: dict[str, Any] = {}
        if op == wire.OP_PING:
            body = {
                "server": "edgeserve",
                "server_version": __version__,
                "wire": wire.VERSION,
                "ready": self.dataplane.ready(),
                "max_inflight": self.max_inflight,
            }
        elif op == wire.OP_REGISTER:
            shm.register(
                codec._field(header, "name", str, "register"),
                codec._field(header, "key", str, "register"),
                codec._field(header, "offset", int, "register", 0),
                codec._field(header, "byte_size", int, "register"),
                owner=peer.owner,
            )
            peer.owns_regions = True
        elif op == wire.OP_UNREGISTER:
            shm.unregister(codec._field(header, "name", str, "unregister", ""), owner=peer.owner)
        elif op == wire.OP_STATUS:
            name = codec._field(header, "name", str, "status", "")
            mine = set(shm.names(owner=peer.owner))
            body = {"regions": [{**info.as_dict(), "mine": info.name in mine} for info in shm.status(name)]}
        elif op == wire.OP_METADATA:
            model = codec._field(header, "model", str, "metadata")
            body = {"metadata": self.dataplane.model_metadata(model, str(header.get("version", "")))}
        elif op == wire.OP_READY:
            model = codec._field(header, "model", str, "ready", "")
            ready = (
                self.dataplane.model_ready(model, str(header.get("version", "")))
                if model
                else self.dataplane.ready()
            )
            body = {"live": self.dataplane.live(), "ready": ready}
        elif op == wire.OP_BYE:
            self._reply(peer, codec.ok_reply(req_id, {}))
            self._forget(peer, "said bye")
            return
        else:
            raise invalid_arg(
                f"unknown op {op!r}; expected one of infer, ping, register, unregister, "
                "status, metadata, ready, bye"
            )
        self._reply(peer, codec.ok_reply(req_id, body))

    # -- send -----------------------------------------------------------------------------------
    def _post(self, peer: _Peer, frames: list[Any]) -> None:
        """Hand a finished request's reply to the loop (any thread)."""
        if threading.get_ident() == self._loop_thread:
            self._finish(peer, frames)
            return
        self._outbox.append((peer, frames))
        if not self._wake_pending:
            self._wake_pending = True
            loop = self._loop
            assert loop is not None
            with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone
                loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self._wake_pending = False  # before draining: a later append schedules its own flush
        outbox = self._outbox
        while outbox:
            peer, frames = outbox.popleft()
            self._finish(peer, frames)

    def _finish(self, peer: _Peer, frames: list[Any]) -> None:
        peer.inflight -= 1
        self._inflight -= 1
        self._reply(peer, frames)
        self._maybe_forget(peer)

    def _send_now(self, frames: list[Any]) -> BaseException | None:
        """Send without blocking; the error, if any (zmq.Again: queue full; EHOSTUNREACH: gone)."""
        sock = self._sock
        if sock is None:
            return None
        error: BaseException | None = None
        try:
            future = cast("asyncio.Future[Any]", sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False))
            if future.done():
                error = future.exception()
        except zmq.ZMQError as exc:
            error = exc
        return error

    def _reply(self, peer: _Peer, frames: list[Any]) -> None:
        error = self._send_now(peer.envelope + frames)
        if error is None:
            return
        if isinstance(error, zmq.Again):
            self._dropped += 1
            now = time.monotonic()
            if now - self._last_drop_log > 1.0:
                self._last_drop_log = now
                log.warning(
                    "zmq client %s is not reading its replies: dropped %d reply(ies) so far",
                    peer.ident.hex(),
                    self._dropped,
                )
        elif isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            self._forget(peer, "disconnected")
        else:
            log.warning("zmq send to %s failed: %s", peer.ident.hex(), error)

    # -- clients that go away -------------------------------------------------------------------
    def _maybe_forget(self, peer: _Peer) -> None:
        if peer.inflight == 0 and not peer.owns_regions and self._peers.get(peer.ident) is peer:
            del self._peers[peer.ident]

    def _forget(self, peer: _Peer, why: str) -> None:
        if self._peers.get(peer.ident) is peer:
            del self._peers[peer.ident]
        if peer.owns_regions:
            self._release_regions(peer, why)

    def _release_regions(self, peer: _Peer, why: str) -> None:
        names = self.dataplane.shm.names(owner=peer.owner)
        peer.owns_regions = False
        if names:
            self.dataplane.shm.unregister("", owner=peer.owner)
            log.info("zmq client %s %s: released its shm regions %s", peer.ident.hex(), why, names)

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        monitor = self._monitor
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except zmq.ZMQError:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                assert self._loop is not None
                for delay in PROBE_DELAYS_S:
                    self._loop.call_later(delay, self._probe_owners)

    def _probe_owners(self) -> None:
        """Find which region owners are gone: ROUTER_MANDATORY fails a send to an unknown identity."""
        if self._sock is None:
            return
        probe = wire.dumps({"v": wire.VERSION, "op": wire.OP_PROBE})
        for peer in [p for p in self._peers.values() if p.owns_regions]:
            error = self._send_now([peer.ident, probe])
            if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
                self._forget(peer, "disconnected")
