"""A camera-like producer process for the e2e tests: frames into a ring, pipelined, every result
checked against the frame it came from. Prints one JSON line at the end (or STREAMING when told to
run until killed).

    python zmq_producer.py ENDPOINT MODEL PRODUCER_ID FRAMES [out_ring] [forever]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from edgeserve.client import ClientError, ZmqClient, ZmqFuture

SHAPE = (1, 16384)  # INT32: 64 KiB frames


def main(argv: list[str]) -> int:
    endpoint, model, producer, frames = argv[0], argv[1], int(argv[2]), int(argv[3])
    out_ring_wanted = "out_ring" in argv[4:]
    forever = "forever" in argv[4:]
    rng = np.random.default_rng(producer)
    ok = mismatched = 0
    errors: list[str] = []
    with ZmqClient(endpoint, timeout=20.0) as client:
        ring = client.create_ring(slots=8, slot_size=4 * SHAPE[1])
        out_ring = client.create_ring(slots=8, slot_size=4 * SHAPE[1]) if out_ring_wanted else None
        in_flight: dict[ZmqFuture, tuple[int, np.ndarray]] = {}

        def collect(future: ZmqFuture) -> None:
            nonlocal ok, mismatched
            index, expected = in_flight.pop(future)
            try:
                got = future.result().as_numpy("OUTPUT0")
            except ClientError as exc:
                errors.append(f"frame {index}: {exc}")
                return
            if got.shape == expected.shape and np.array_equal(got, expected):
                ok += 1
            else:
                mismatched += 1

        index = 0
        while forever or index < frames:
            slot = client.acquire_slot(ring)
            frame = slot.ndarray(SHAPE, np.int32)
            frame[:] = rng.integers(-(2**31), 2**31 - 1, SHAPE, dtype=np.int32)
            frame[0, 0], frame[0, 1] = producer, index
            outputs = {"OUTPUT0": out_ring} if out_ring is not None else None
            future = client.submit(model, {"INPUT0": slot.tensor(SHAPE, np.int32)}, outputs)
            in_flight[future] = (index, frame.copy())
            index += 1
            if forever and index == 50:
                print("STREAMING", ring.name, flush=True)
            client.poll(0)
            for done in [f for f in in_flight if f.done()]:
                collect(done)
        for done in client.as_completed(list(in_flight), timeout=60):
            collect(done)
    print(
        json.dumps({"producer": producer, "ok": ok, "mismatched": mismatched, "errors": errors[:5]}),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
