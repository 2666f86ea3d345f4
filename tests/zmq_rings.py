"""A ZeroMQ request naming a slot of a client's frame ring (tests/frontends/zmq and tests/security)."""

from __future__ import annotations

from edgeserve.client.ring import FrameRing
from edgeserve.frontends.zmq import wire


def ring_request(ring: FrameRing, slot: int, gen: int) -> dict[str, object]:
    ref = wire.shm_ref(ring.name, 16, slot=slot, gen=gen)
    return {"v": 1, "model": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "shm": ref}]}
