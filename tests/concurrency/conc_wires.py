"""Every wire the suite's clients use, by name; `connect` opens one for a client thread."""

from __future__ import annotations

import time

from conc_shared import GrpcAioTransport, HttpAioTransport, ZmqAioTransport
from conc_transports import (
    Endpoints,
    GrpcStreamTransport,
    GrpcTransport,
    HttpTransport,
    Transport,
    ZmqRingTransport,
    ZmqTransport,
)

FACTORIES: dict[str, type[Transport]] = {
    "http": HttpTransport,
    "grpc": GrpcTransport,
    "grpc_stream": GrpcStreamTransport,
    "zmq": ZmqTransport,
    "zmq_ring": ZmqRingTransport,
    "grpc_aio": GrpcAioTransport,
    "http_aio": HttpAioTransport,
    "zmq_aio": ZmqAioTransport,
}
TRANSPORTS = tuple(FACTORIES)
# Wires that keep a client's requests in the order sent (a sequence's steps may be pipelined on them).
ORDERED = frozenset({"grpc_stream", "zmq", "zmq_ring", "zmq_aio"})
# Wires where an op's calls may all be in flight at once (stateless ones).
CONCURRENT = ORDERED | {"grpc_aio", "http_aio"}


def connect(name: str, endpoints: Endpoints, attempts: int = 3) -> Transport:
    """A transport of kind `name` (one of TRANSPORTS) to the server."""
    for attempt in range(attempts):
        try:
            return FACTORIES[name](endpoints)
        except Exception:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")
