"""What the sync and asyncio ZeroMQ clients share besides the messages (`_core`): their state, the
request options, request ids, what happens to requests that time out and to their late replies, the
sealed-ring fallback, and closing. Each client adds only how it waits: futures it pumps itself, or
asyncio futures completed from the socket's reader callback."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypedDict, TypeVar

import zmq

from edgeserve.client import _core
from edgeserve.client._core import InputValue, Outputs, Pending
from edgeserve.client.endpoint import check_ipc, find_endpoint, foreign_peer
from edgeserve.client.errors import ClientError
from edgeserve.client.lane import HeaderFrame
from edgeserve.client.ring import FrameRing
from edgeserve.client.stream import StreamState
from edgeserve.frontends.zmq import wire

LATE_MAX = 4096  # timed-out requests remembered so a late reply can free their slots
# A sealed memfd is reachable only from the server's user and PID namespace (a producer in another
# container is not): registering one is refused with these, and a /dev/shm ring (read with one copy)
# is registered instead.
_SEALED_REFUSED = ("NOT_FOUND", "PERMISSION_DENIED", "INVALID_ARG")


class RequestOptions(TypedDict, total=False):
    """The keyword options of `submit` and `infer` besides `timeout`."""

    version: str  # "" (default): the model's default version
    ring: FrameRing | None  # numpy inputs are copied into a slot of it instead of sent inline
    priority: int
    timeout_us: int  # the server's own queue timeout for this request (0: the model's)
    parameters: Mapping[str, Any] | None


class ConnectionOptions(TypedDict, total=False):
    """The keyword options of a client's constructor (see ClientBase)."""

    copy_inputs: bool
    context: zmq.Context[Any] | None
    identity: bytes | None
    server_user: str | int | None


Entry = TypeVar("Entry")  # what a client keeps for a request in flight


class ClientBase(Generic[Entry]):
    """`endpoint`: None finds the appliance's as its settings say (client/endpoint.py).
    `timeout` (seconds) bounds every request unless a call passes its own. With `copy_inputs=False`
    large inline inputs are sent without a copy: do not modify them until their future is done.
    `context`: any zmq.Context (a zmq.asyncio one too: the socket made here is a plain one).
    `server_user` (name or uid): whose ipc socket is the server's (default: the owner of the
    socket's folder, or ours); a socket or reply of anyone else is refused (PERMISSION_DENIED)."""

    def __init__(
        self,
        endpoint: str | None = None,
        timeout: float = 10.0,
        *,
        copy_inputs: bool = True,
        context: zmq.Context[Any] | None = None,
        identity: bytes | None = None,
        server_user: str | int | None = None,
    ) -> None:
        endpoint = endpoint or find_endpoint()
        self.endpoint = endpoint
        self._owners = check_ipc(endpoint, server_user)  # None: tcp:// or abstract, nothing to check
        self._peer_ok = ""  # the last Peer-Address found to be the server's
        self.timeout = timeout
        self.copy_inputs = copy_inputs
        self.identity = identity or uuid.uuid4().bytes
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = _core.dealer_socket(self._ctx, endpoint, self.identity, timeout)
        self._next_id = _core.first_request_id()
        self._pending: dict[int, Entry] = {}
        self._late: dict[int, Pending] = {}
        self._streams: dict[int, StreamState] = {}  # streamed requests whose final reply has not come
        self._rings: list[FrameRing] = []
        self._registrations = _core.Registrations()

    def _take_id(self) -> int:
        req_id = self._next_id
        self._next_id += 1
        return req_id

    def _request(
        self, model: str, inputs: Mapping[str, InputValue], outputs: Outputs, options: RequestOptions
    ) -> tuple[Pending, list[Any]]:
        pending = Pending(self._take_id())
        return pending, _core.build_infer(
            pending, model, inputs, outputs, copy_inputs=self.copy_inputs, **options
        )

    def _stream_request(
        self, model: str, inputs: Mapping[str, InputValue], outputs: Sequence[str] | None,
        options: RequestOptions, timeout: float | None,
    ) -> tuple[StreamState, list[Any]]:  # fmt: skip
        """A streamed request's state and frames (outputs by name only: every response comes inline)."""
        if isinstance(outputs, (str, Mapping)):
            raise ClientError(
                "INVALID_ARG", "a streamed request's outputs are a list of names (they come inline)"
            )
        pending = Pending(self._take_id())
        frames = _core.build_infer(
            pending, model, inputs, outputs, copy_inputs=self.copy_inputs, stream=True, **options
        )
        return StreamState(pending, self.timeout if timeout is None else timeout), frames

    def _open_socket(self, pending: Pending | None) -> zmq.Socket[Any]:
        """The socket to send on; UNAVAILABLE (and the request's slots given back) once closed."""
        sock = self._sock
        if sock is None:
            if pending is not None:
                pending.release_slots()
            raise ClientError("UNAVAILABLE", "the client is closed")
        return sock

    def _unreachable(self, pending: Pending | None) -> ClientError:
        """The error of a request the socket did not take (no server): its slots are given back."""
        if pending is not None:
            pending.release_slots()
        return ClientError(
            "UNAVAILABLE",
            f"cannot reach edgeserve at {self.endpoint} (is `edgeserve run` serving this endpoint?)",
        )

    def _answered(self, msg: Sequence[Any]) -> tuple[dict[str, Any], Entry] | None:
        """A reply's header and the entry of the request it answers (taken out of the pending ones);
        None for anything else (dropped): a probe, a malformed or unknown reply, or the late reply of
        a request that timed out, whose slots are safe to reuse now."""
        try:
            header = wire.loads(msg[0].buffer)
        except ValueError:
            return None
        if not isinstance(header, dict) or header.get("op") == wire.OP_PROBE:
            return None
        req_id = header.get("id")
        stream = self._streams.get(req_id) if isinstance(req_id, int) else None
        if stream is not None and isinstance(req_id, int):  # one of a streamed request's replies
            if self._owners is not None:
                refused = self._foreign(msg[0])
                if refused is not None:
                    header = {"id": req_id, "status": "PERMISSION_DENIED", "message": refused}
            if stream.deliver(header, msg[1:]):
                del self._streams[req_id]
            return None
        entry = self._pending.pop(req_id, None) if isinstance(req_id, int) else None
        if entry is None:
            late = self._late.pop(req_id, None) if isinstance(req_id, int) else None
            if late is not None:
                for slot in late.slots:
                    slot.ring.release(slot)
            return None
        if self._owners is not None:
            refused = self._foreign(msg[0])
            if refused is not None:
                return {"id": req_id, "status": "PERMISSION_DENIED", "message": refused}, entry
        return header, entry

    def _foreign(self, frame: Any) -> str | None:
        """Why the reply `frame` is not the server's (None: it is). One string compare per reply:
        the sender's Peer-Address is looked into only when it changes (a new connection)."""
        if type(frame) is HeaderFrame:  # a lane's: its server was checked when it connected
            return None
        try:
            address = frame.get("Peer-Address")
        except Exception:  # no metadata on this message: nothing to tell by
            return None
        if address == self._peer_ok:
            return None
        assert self._owners is not None
        refused = foreign_peer(address, self._owners, self.endpoint)
        if refused is None:
            self._peer_ok = address
        return refused

    def _outcome(
        self, header: dict[str, Any], frames: Sequence[Any], pending: Pending | None, copy: bool = True
    ) -> tuple[Any, ClientError | None]:
        """(result, None) or (None, error) of a reply: the header of a control reply, else the
        InferResult (the caller gives the request's slots back once its future is done)."""
        try:
            if pending is None:
                _core.check_status(header)
                return header, None
            return _core.parse_infer(header, frames, pending, copy), None
        except ClientError as exc:
            self._registrations.note(exc)
            return None, exc

    def _timed_out(self, req_id: int, pending: Pending | None) -> ClientError:
        """The error of a request that got no reply in time. Its slots stay quarantined until its
        late reply comes (the server may still write them), for the last LATE_MAX such requests."""
        if pending is not None:
            for slot in pending.slots:
                slot.ring.quarantine(slot)
            self._late[req_id] = pending
            if len(self._late) > LATE_MAX:
                self._late.pop(next(iter(self._late)))
        return ClientError("DEADLINE_EXCEEDED", f"no reply to request {req_id} from {self.endpoint} in time")

    def _ring_refused(
        self, ring: FrameRing, exc: BaseException, slots: int, slot_size: int, name: str | None
    ) -> FrameRing:
        """`ring`, whose registration failed with `exc`, closed; the /dev/shm ring to register instead
        when the server refused a sealed one, else `exc` raised."""
        ring.close()
        if not ring.sealed or not isinstance(exc, ClientError) or exc.status not in _SEALED_REFUSED:
            raise exc
        return FrameRing(slots, slot_size, name=name, sealed=False)

    def _close_socket(self) -> None:
        assert self._sock is not None
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.fail(ClientError("UNAVAILABLE", "the client was closed"))
        self._sock.close(linger=0)
        self._sock = None
        for ring in self._rings:
            ring.close()
        self._rings = []
