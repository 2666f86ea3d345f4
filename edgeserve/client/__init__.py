"""edgeserve Python clients for the local fast path: ZeroMQ (sync and asyncio) and the shm frame ring.

For gRPC and HTTP use `tritonclient` unchanged. Importing this package needs only numpy and pyzmq.

    from edgeserve.client import ZmqClient
    with ZmqClient(timeout=1.0) as client:  # the appliance's endpoint, found as its settings say
        ring = client.create_ring(slots=8, slot_size=640 * 480 * 3)
        result = client.infer("detector", {"images": frame}, ring=ring)
        scores = result.as_numpy("scores")
"""

from edgeserve.client._core import InferResult
from edgeserve.client.aio import AsyncZmqClient
from edgeserve.client.endpoint import find_endpoint
from edgeserve.client.errors import ClientError, RingFull
from edgeserve.client.future import ZmqFuture
from edgeserve.client.ring import FrameRing, ShmTensor, Slot
from edgeserve.client.zmq_client import ZmqClient

__all__ = [
    "AsyncZmqClient",
    "ClientError",
    "FrameRing",
    "InferResult",
    "RingFull",
    "ShmTensor",
    "Slot",
    "ZmqClient",
    "ZmqFuture",
    "find_endpoint",
]
