# (pyproject's follow_imports=skip for zmq.* hides pyzmq's own types; see edgeserve/frontends/zmq/README.md)
"""ZeroMQ frontend: one ROUTER socket (ipc:// and tcp:// endpoints) served by its own thread.

Many requests may be in flight per client (DEALER) socket, up to `zmq.max_inflight_per_client`.
Requests go to the one data plane with `DataPlane.submit`; its callback runs on a worker thread,
which builds the reply frames and sends them itself (see router.py), or, for a model that computes
in under `zmq.inline_max_us` with an instance idle, on the router thread itself. Sends never block:
a client whose queue is full loses that reply (logged), a client that is gone is forgotten and its
shared-memory regions are unregistered from the registry every frontend shares.
Everything here except `_post`/`_reply` (worker threads) runs on the router thread.

Bounds: a request (all its frames) larger than `zmq.max_message_bytes` (0 = sized for the device,
the same limit as HTTP and gRPC) is refused with RESOURCE_EXHAUSTED (a single frame past it drops
the connection: ZMQ_MAXMSGSIZE); at most `zmq.max_clients` client sockets are known at once (a new
one past that is refused until idle ones are forgotten). A full model queue is shared fairly
between clients (each request carries its client's identity; see scheduling/queue.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from edgeserve import __version__, metrics
from edgeserve.frontends.limits import request_limit, too_large_message
from edgeserve.frontends.peer import zmq_peer, zmq_peer_credentials_work
from edgeserve.frontends.shm.binding import PeerIdentity, ShmClient
from edgeserve.frontends.zmq import codec, replies, wire
from edgeserve.frontends.zmq.endpoint import ipc_path, server_default
from edgeserve.frontends.zmq.lane import ID_UNKNOWN, OP_LANE, Lane, Lanes, lane_message
from edgeserve.frontends.zmq.metrics import ZmqCollector
from edgeserve.frontends.zmq.router import Router
from edgeserve.frontends.zmq.streams import Live, StreamPump
from edgeserve.protocol.errors import InferenceError, Status, internal, invalid_arg
from edgeserve.scheduling.job import CURRENT_CLIENT

if TYPE_CHECKING:
    from edgeserve.config import Settings
    from edgeserve.protocol.inference import InferResponse
    from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.zmq")

PROBE_DELAYS_S = (0.0, 0.2)  # check region owners right after a disconnect, and once more
SWEEP_S = 5.0  # forget idle clients that own nothing
IDENTITIES_MAX = 1024  # peer identities remembered by address (the client cap is far above a box's users)
BUSY_INLINE_MAX_NS = 100_000  # the longest inline run while other requests wait (as [http] inline_max_us)


class _Peer:
    __slots__ = ("envelope", "ident", "inflight", "owner", "owns_regions", "shm_client", "streams")

    def __init__(self, ident: bytes, envelope: list[bytes]) -> None:
        self.ident = ident
        self.envelope = envelope
        self.owner = "zmq:" + ident.hex()
        self.inflight = 0  # +1 on the loop thread, -1 on a worker thread (under _count_lock)
        self.owns_regions = False
        self.streams: dict[Any, Live] = {}  # live streamed requests by id (router thread)
        self.shm_client: tuple[str, ShmClient] | None = None  # (Peer-Address, its ShmClient), router thread


class ZmqFrontend:
    name = "zmq"

    def __init__(self, dataplane: DataPlane, settings: Settings) -> None:
        self.dataplane = dataplane
        # [] = the default: in a folder only the service user can write (endpoint.py)
        self.default_endpoint = (
            "" if settings.zmq.endpoints else f"ipc://{server_default(settings.server.state_dir)}"
        )
        self.endpoints = list(settings.zmq.endpoints) or [self.default_endpoint]
        self.max_inflight = max(1, settings.zmq.max_inflight_per_client)
        self.inline_max_ns = max(0, settings.zmq.inline_max_us) * 1000
        self.spin_us = settings.zmq.spin_us
        self.max_message_bytes = request_limit(settings.zmq.max_message_bytes, settings)
        self.max_clients = max(1, settings.zmq.max_clients)
        self._refused_clients = 0
        self.bound: list[str] = []  # resolved endpoints (tcp://...:* gets its port)
        self._peers: dict[bytes, _Peer] = {}
        self._count_lock = threading.Lock()
        self._inflight = 0
        self._router: Router | None = None
        self._dropped = 0
        self._inline_runs = 0
        self._last_drop_log = 0.0
        self._collector = ZmqCollector(self)
        self._peer_credentials = False  # libzmq reports ipc peers' SO_PEERCRED (checked at start)
        self._identities: dict[str, PeerIdentity] = {}  # by Peer-Address
        self._lanes: Lanes | None = None  # lane.py: local clients past libzmq's I/O threads
        self._pump = StreamPump(lambda: self._router, self._stream_finished, self._stream_unreachable)

    def apply_limits(self, settings: Settings) -> None:
        """SIGHUP: limits that change live (the socket's high-water mark stays as bound)."""
        self.max_inflight = max(1, settings.zmq.max_inflight_per_client)
        self.inline_max_ns = max(0, settings.zmq.inline_max_us) * 1000

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        router = Router(
            self._handle, self._on_disconnect, sndhwm=max(1000, 2 * self.max_inflight), spin_us=self.spin_us,
            max_message_bytes=self.max_message_bytes,
        )  # fmt: skip
        try:
            router.bind(self.endpoints, default=self.default_endpoint)
        except BaseException:
            router.close()
            raise
        self._router = router
        self.bound = router.bound
        if any(endpoint.startswith("ipc://") for endpoint in self.bound):
            self._peer_credentials = zmq_peer_credentials_work()
            if not self._peer_credentials:
                log.warning("libzmq reports no credentials of ipc peers here: for shared memory they count "
                            "as clients of unknown user ([shm] registration)")  # fmt: skip
        lane_at = [(e, path) for e in self.bound if (path := ipc_path(e)) is not None]
        if self._peer_credentials and lane_at:  # a lane is bound to its user: needs ipc credentials
            lanes = Lanes(*lane_at[0], router.watch, router.route,
                          lambda lane, frames: self._handle(lane_message(lane, frames), lane))  # fmt: skip
            self._lanes = lanes
            router.call_soon(lanes.start)
        router.call_later(SWEEP_S, self._sweep)
        router.start()
        metrics.register_collector(self._collector)
        log.info("zmq frontend listening on %s", ", ".join(self.bound))

    async def stop(self, grace_s: float) -> None:
        """Keep answering (the data plane refuses new work while shutting down) until in-flight
        requests are done or `grace_s` passes, then close."""
        deadline = time.monotonic() + max(0.0, grace_s)
        while self._inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        metrics.unregister_collector(self._collector)
        router, self._router = self._router, None
        if router is not None:  # joins the router thread: the peers are ours from here on
            await asyncio.get_running_loop().run_in_executor(None, router.close)
        if self._lanes is not None:
            self._lanes.close()
        for peer in list(self._peers.values()):
            for live in list(peer.streams.values()):  # their models see cancelled
                self._pump.cancel(live, reply=False)
            if peer.owns_regions:
                self._release_regions(peer, "server stopping")
        self._peers.clear()
        log.info("zmq frontend stopped (%d request(s) still in flight)", self._inflight)

    # -- receive --------------------------------------------------------------------------------
    def _handle(self, msg: list[Any], lane: Lane | None = None) -> None:
        """One message from the socket, or from `lane` (its reply then goes back over the lane)."""
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
            peer = _Peer(ident, envelope)
            if len(self._peers) >= self.max_clients:
                self._refused_clients += 1
                error = InferenceError(
                    Status.RESOURCE_EXHAUSTED,
                    f"too many zmq clients (max {self.max_clients}, [zmq] max_clients); try again later",
                )
                self._reply(peer, replies.error_reply(None, error))
                return
            self._peers[ident] = peer
        try:
            header = wire.loads(msg[index].buffer)
        except ValueError:
            self._reply(peer, replies.error_reply(None, invalid_arg("header frame is not valid JSON")))
            self._maybe_forget(peer)
            return
        if lane is not None and index == 1:  # parsed once, here: the lane routes its reply by its id
            lane.asked(header)
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
                self._infer(peer, header, msg[index], msg[index + 1 :])
                return
            if op == wire.OP_CANCEL:  # no reply of its own: the stream's final one says CANCELLED
                live = peer.streams.get(req_id) if isinstance(req_id, (int, str)) else None
                if live is not None:
                    self._pump.cancel(live)
                return
            self._control(peer, op, header, msg[index])
        except InferenceError as exc:
            self._reply(peer, replies.error_reply(req_id, exc))
        except Exception as exc:
            log.exception("zmq request %r failed", req_id)
            self._reply(peer, replies.error_reply(req_id, internal(f"internal error: {exc}")))
        self._maybe_forget(peer)

    def _shm_client(self, peer: _Peer, frame: Any) -> ShmClient:
        """Who names shm regions: this socket, as the user libzmq says sent `frame` (read per message:
        a routing id reused by another connection lends it nothing). The identity follows from the
        Peer-Address alone (`_peer_of`), so the socket keeps the client of its last address: a camera's
        requests all come from one, and each would otherwise look it up again."""
        try:
            address = frame.get("Peer-Address")
        except Exception:  # no metadata on this message: looked up (zmq_peer says what that means)
            return ShmClient(lambda: self._peer_of(frame), owner=peer.owner)
        cached = peer.shm_client
        if cached is not None and cached[0] == address:
            return cached[1]
        client = ShmClient(self._peer_of(frame), owner=peer.owner)
        peer.shm_client = (address, client)
        return client

    def _peer_of(self, frame: Any) -> PeerIdentity:
        """`zmq_peer(frame)`, memoised by the Peer-Address libzmq reports for this very message: the
        identity follows from that string alone, and a ring request names a region every time."""
        try:
            address = frame.get("Peer-Address")
        except Exception:  # no metadata on this message: zmq_peer says what that means
            return zmq_peer(frame, self._peer_credentials)
        identity = self._identities.get(address) or zmq_peer(frame, self._peer_credentials)
        if len(self._identities) >= IDENTITIES_MAX:  # any thread: single dict operations, bounded
            self._identities.clear()
        self._identities[address] = identity
        return identity

    def _infer(self, peer: _Peer, header: dict[str, Any], head: Any, frames: list[Any]) -> None:
        size = sum(len(frame) for frame in frames) if frames else 0
        if size > self.max_message_bytes:
            raise InferenceError(
                Status.RESOURCE_EXHAUSTED,
                too_large_message(size, self.max_message_bytes, "[zmq] max_message_bytes"),
            )
        if peer.inflight >= self.max_inflight:
            raise InferenceError(
                Status.RESOURCE_EXHAUSTED,
                f"too many requests in flight from this client (max {self.max_inflight}); "
                "wait for replies before sending more",
            )
        # UNAVAILABLE at once, before decoding, when the server is at its limit or the queue is full
        model, version = header.get("model"), header.get("version", "")
        self.dataplane.admit(
            model if isinstance(model, str) else "",
            str(version) if isinstance(version, (str, int)) else "",
            peer.owner,
        )
        try:
            decoded = codec.decode_infer(header, frames, self.dataplane.shm, self._shm_client(peer, head))
        except BaseException:
            self.dataplane.release()
            raise
        if header.get("stream", False) is not False:
            self._start_stream(peer, header, decoded)
            return
        with self._count_lock:
            peer.inflight += 1
            self._inflight += 1

        def on_done(result: InferResponse | InferenceError) -> None:
            try:
                try:
                    if isinstance(result, InferenceError):
                        reply = replies.error_reply(decoded.req_id, result)
                    else:
                        reply = replies.infer_reply(decoded, result)
                except InferenceError as exc:
                    reply = replies.error_reply(decoded.req_id, exc)
                except Exception as exc:
                    log.exception("building the zmq reply for request %r failed", decoded.req_id)
                    reply = replies.error_reply(
                        decoded.req_id, internal(f"internal error building the reply: {exc}")
                    )
                self._post(peer, reply, decoded.req_id)
            finally:
                decoded.release()  # after the send: the slot guards are checked, the reply goes first

        # While other requests wait, only a tiny model runs here: for a longer one the workers (and the
        # batcher) do better, and those requests would wait for it; a tiny one costs less than the
        # hand-off to a worker and back would.
        router = self._router
        inline = 0
        if router is not None:
            inline = (
                min(self.inline_max_ns, BUSY_INLINE_MAX_NS) if router.input_waiting() else self.inline_max_ns
            )
        token = CURRENT_CLIENT.set(peer.owner)  # fair shares of a full queue, per client socket
        try:
            if self.dataplane.submit(decoded.request, on_done, inline_max_ns=inline, admitted=True):
                self._inline_runs += 1
        finally:
            CURRENT_CLIENT.reset(token)

    def _start_stream(self, peer: _Peer, header: dict[str, Any], decoded: codec.Decoded) -> None:
        """A streamed request: 0..N replies through the data plane's bounded ResponseStream (streams.py)."""
        req_id = decoded.req_id
        key = req_id if isinstance(req_id, (int, str)) else None
        try:
            if header.get("stream") is not True:
                raise invalid_arg(f"request header: field 'stream' must be bool, not {header['stream']!r}")
            if decoded.out_slots or any(out.shm is not None for out in decoded.request.outputs or ()):
                raise invalid_arg("a streamed request's outputs come inline, one reply per response: "
                                  "remove 'shm' from its outputs")  # fmt: skip
            if key is not None and key in peer.streams:
                raise invalid_arg(f"request id {req_id!r} is already streaming on this client")
        except BaseException:
            decoded.release()
            self.dataplane.release()
            raise
        live = Live(peer, peer.envelope, decoded, key)
        with self._count_lock:
            peer.inflight += 1
            self._inflight += 1
        if key is not None:
            peer.streams[key] = live
        token = CURRENT_CLIENT.set(peer.owner)
        try:
            notify = self._pump.notifier(live)
            live.stream = self.dataplane.submit_stream(decoded.request, notify, admitted=True)
        finally:
            CURRENT_CLIENT.reset(token)

    def _stream_finished(self, live: Live) -> None:
        peer: _Peer = live.owner
        if live.key is not None and peer.streams.get(live.key) is live:
            del peer.streams[live.key]
        live.decoded.release()
        with self._count_lock:
            peer.inflight -= 1
            self._inflight -= 1

    def _stream_unreachable(self, live: Live) -> None:
        self._forget(live.owner, "disconnected")

    def counters(self) -> dict[str, int]:
        """For /metrics (any thread: plain reads of ints the router thread updates)."""
        router = self._router
        return {
            "requests": router.handled if router is not None else 0,
            "inline_runs": self._inline_runs,
            "spin_hits": router.spin_hits if router is not None else 0,
            "dropped_replies": self._dropped,
            "refused_clients": self._refused_clients,
            "clients": len(self._peers),
            "inflight": self._inflight,
        }

    # -- control messages -----------------------------------------------------------------------
    def _control(self, peer: _Peer, op: Any, header: dict[str, Any], frame: Any) -> None:
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
                peer=self._shm_client(peer, frame).peer,
            )
            peer.owns_regions = True
        elif op == wire.OP_UNREGISTER:
            name = codec._field(header, "name", str, "unregister", "")
            shm.unregister(name, owner=peer.owner, client=self._shm_client(peer, frame))
        elif op == wire.OP_STATUS:
            name = codec._field(header, "name", str, "status", "")
            mine = set(shm.names(owner=peer.owner))
            listed = shm.status(name, client=self._shm_client(peer, frame))
            body = {"regions": [{**info.as_dict(), "mine": info.name in mine} for info in listed]}
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
        elif op == OP_LANE:
            if self._lanes is None:
                raise InferenceError(Status.UNSUPPORTED, "no lane here (ipc:// endpoints only)")
            principal = self._shm_client(peer, frame).principal
            body = {"token": self._lanes.issue(peer.ident, principal).hex()}
        elif op == wire.OP_BYE:
            # Release first, then reply (as the wire spec says): a client that got its answer may
            # rely on its regions being gone (the test that lists them right after close() raced).
            self._forget(peer, "said bye")
            self._reply(peer, replies.ok_reply(req_id, {}))
            return
        else:
            raise invalid_arg(
                f"unknown op {op!r}; expected one of infer, ping, register, unregister, "
                "status, metadata, ready, lane, bye"
            )
        self._reply(peer, replies.ok_reply(req_id, body))

    # -- send -----------------------------------------------------------------------------------
    def _post(self, peer: _Peer, frames: list[Any], req_id: Any) -> None:
        """Send a finished request's reply (on a worker thread, or the loop for early errors)."""
        with self._count_lock:
            peer.inflight -= 1
            self._inflight -= 1
        self._reply(peer, frames, req_id)

    def _reply(self, peer: _Peer, frames: list[Any], req_id: Any = ID_UNKNOWN) -> None:
        """`req_id`: the id in the header of `frames`, when known (else read from it where needed)."""
        router = self._router
        if router is None:
            return
        error = router.send(peer.envelope + frames, req_id)
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
            router.call_soon(lambda: self._forget(peer, "disconnected"))
        else:
            log.warning("zmq send to %s failed: %s", peer.ident.hex(), error)

    # -- clients that go away -------------------------------------------------------------------
    def _maybe_forget(self, peer: _Peer) -> None:
        if peer.inflight == 0 and not peer.owns_regions and self._peers.get(peer.ident) is peer:
            del self._peers[peer.ident]

    def _forget(self, peer: _Peer, why: str) -> None:
        if self._peers.get(peer.ident) is peer:
            del self._peers[peer.ident]
        for live in list(peer.streams.values()):  # nobody reads them: their models see cancelled
            self._pump.cancel(live, reply=False)
        if peer.owns_regions:
            self._release_regions(peer, why)

    def _release_regions(self, peer: _Peer, why: str) -> None:
        names = self.dataplane.shm.drop_owner(peer.owner)
        peer.owns_regions = False
        if names:
            log.info("zmq client %s %s: released its shm regions %s", peer.ident.hex(), why, names)

    def _on_disconnect(self) -> None:
        router = self._router
        if router is not None:
            for delay in PROBE_DELAYS_S:
                router.call_later(delay, self._probe_owners)

    def _sweep(self) -> None:
        for peer in list(self._peers.values()):
            self._maybe_forget(peer)
        router = self._router
        if router is not None:
            router.call_later(SWEEP_S, self._sweep)

    def _probe_owners(self) -> None:
        """Find which region owners are gone: ROUTER_MANDATORY fails a send to an unknown identity."""
        router = self._router
        if router is None:
            return
        probe = wire.dumps({"v": wire.VERSION, "op": wire.OP_PROBE})
        for peer in [p for p in self._peers.values() if p.owns_regions or p.streams]:
            error = router.send([peer.ident, probe])
            if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
                self._forget(peer, "disconnected")
