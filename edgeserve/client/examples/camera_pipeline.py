"""A camera pipeline feeding edgeserve over ZeroMQ + a shared-memory frame ring.

Frames are synthetic (a moving pattern) or read from a video file with OpenCV when it is
installed. Each frame is written straight into a free ring slot (no extra copy), a reference goes
to the server, and the slot comes back when the result is in. When every slot is busy, or the
model's queue is full, the frame is dropped and counted: the producer never blocks the appliance.

    edgeserve run &                                     # serves models/ over ZeroMQ (docs/zmq.md)
    python -m edgeserve.client.examples.camera_pipeline --model ppocr_det --size 320x320 --frames 120
    python -m edgeserve.client.examples.camera_pipeline --model ppocr_det --video clip.mp4 --fps 30

Prints one line per frame (latency from submit to result) and a summary.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from edgeserve.client import ClientError, ZmqClient, ZmqFuture
from edgeserve.client.zmq_client import DEFAULT_SPIN_US
from edgeserve.protocol import datatypes


def synthetic_frames(height: int, width: int, count: int) -> Iterator[np.ndarray]:
    """BGR uint8 frames: a diagonal gradient that moves one pixel per frame."""
    ys, xs = np.mgrid[0:height, 0:width]
    for index in range(count):
        base = ((xs + ys + index) % 256).astype(np.uint8)
        yield np.stack([base, np.roll(base, index, axis=1), 255 - base], axis=-1)


def video_frames(path: str, height: int, width: int, count: int) -> Iterator[np.ndarray]:
    try:
        import cv2
    except ImportError:
        raise SystemExit("reading a video file needs OpenCV: pip install opencv-python-headless") from None
    capture = cv2.VideoCapture(path)
    if not capture.isOpened():
        raise SystemExit(f"cannot open video {path}")
    try:
        for _ in range(count):
            ok, image = capture.read()
            if not ok:
                return
            yield cv2.resize(image, (width, height))
    finally:
        capture.release()


def model_input(client: ZmqClient, model: str, height: int, width: int) -> tuple[str, str, tuple[int, ...]]:
    """The first input's name, datatype and a concrete batch-1 shape (NCHW or NHWC, 3 channels)."""
    meta = client.metadata(model)
    spec = meta["inputs"][0]
    dims = [int(d) for d in spec["shape"]]
    if len(dims) != 4:
        raise SystemExit(
            f"model '{model}' input '{spec['name']}' has shape {dims}; this example feeds images"
        )
    nchw = dims[1] == 3
    wanted = [1, 3, height, width] if nchw else [1, height, width, 3]
    shape = tuple(w if d == -1 else d for d, w in zip(dims, wanted, strict=True))
    return spec["name"], spec["datatype"], shape


def fill(view: np.ndarray, frame: np.ndarray) -> None:
    """Write a BGR uint8 frame into the slot view: NHWC as is, NCHW float scaled to [0, 1]."""
    if view.shape[1] == 3:  # NCHW
        chw = frame.transpose(2, 0, 1)
        if view.dtype == np.uint8:
            view[0] = chw
        else:
            np.multiply(chw, 1.0 / 255.0, out=view[0], casting="unsafe")
    else:
        view[0] = frame


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", help="default: the appliance's, as its settings say")
    parser.add_argument("--model", default="ppocr_det")
    parser.add_argument("--size", default="320x320", help="HxW of the frames (and of dynamic model inputs)")
    parser.add_argument("--video", help="a video file to read with OpenCV (default: synthetic frames)")
    parser.add_argument("--frames", type=int, default=120)
    parser.add_argument("--fps", type=float, default=30.0, help="0 = as fast as slots come back, no drops")
    parser.add_argument("--inflight", type=int, default=4, help="ring slots = frames in flight at most")
    parser.add_argument(
        "--output-ring",
        type=int,
        default=0,
        metavar="BYTES",
        help="put the first output into slots of this size (default: inline)",
    )
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument(
        "--spin-us", type=int, default=DEFAULT_SPIN_US, help="busy-wait for replies (0 = never)"
    )
    parser.add_argument("--quiet", action="store_true", help="only the summary")
    args = parser.parse_args(argv)
    height, width = (int(v) for v in args.size.lower().split("x"))

    with ZmqClient(args.endpoint, timeout=args.timeout, spin_us=args.spin_us) as client:
        try:
            client.ping()
            name, datatype, shape = model_input(client, args.model, height, width)
            outputs_meta = client.metadata(args.model)["outputs"]
        except ClientError as exc:
            print(f"edgeserve: {exc}", file=sys.stderr)
            return 1
        dtype = datatypes.numpy_dtype(datatype)
        ring = client.create_ring(args.inflight, int(np.prod(shape)) * dtype.itemsize)
        out_ring = client.create_ring(args.inflight, args.output_ring) if args.output_ring else None
        outputs: Any = {outputs_meta[0]["name"]: out_ring} if out_ring is not None else None
        source = (
            video_frames(args.video, height, width, args.frames)
            if args.video
            else synthetic_frames(height, width, args.frames)
        )
        print(
            f"{args.model}: input '{name}' {datatype} {list(shape)}, {args.inflight} slots of "
            f"{ring.slot_size} bytes in shm '{ring.key}'; "
            f"{'video ' + args.video if args.video else 'synthetic frames'}"
        )

        in_flight: dict[ZmqFuture, tuple[int, float]] = {}
        latencies: list[float] = []
        dropped = rejected = failed = 0

        def collect(future: ZmqFuture) -> None:
            nonlocal rejected, failed
            index, sent = in_flight.pop(future)
            error = future.exception()
            if error is None:
                latency = time.perf_counter() - sent
                latencies.append(latency)
                if not args.quiet:
                    out = future.result().outputs
                    first = next(iter(out.values())) if out else None
                    what = f"{first.dtype}{list(first.shape)}" if first is not None else "written to shm"
                    print(f"frame {index:5d}  {latency * 1e3:7.2f} ms  result {what}")
            elif isinstance(error, ClientError) and error.status == "UNAVAILABLE":
                rejected += 1  # the model's queue is full: this frame is dropped
                if not args.quiet:
                    print(f"frame {index:5d}  dropped by the server: {error.message}")
            else:
                failed += 1
                print(f"frame {index:5d}  failed: {error}", file=sys.stderr)

        started = time.perf_counter()
        for index, frame in enumerate(source):
            if args.fps > 0:
                delay = started + index / args.fps - time.perf_counter()
                if delay > 0:
                    client.poll(delay)  # receive results while waiting for the next frame
            for done in [f for f in in_flight if f.done()]:
                collect(done)
            # Live camera: never wait, drop the frame when every slot is in flight.
            # --fps 0 (a file as fast as possible): wait for a slot to come back instead.
            slot = ring.try_acquire() if args.fps > 0 else client.acquire_slot(ring)
            if slot is None:
                dropped += 1
                if not args.quiet:
                    print(f"frame {index:5d}  dropped: all {ring.slots} slots in flight")
                continue
            fill(slot.ndarray(shape, dtype), frame)
            future = client.submit(args.model, {name: slot.tensor(shape, dtype)}, outputs)
            in_flight[future] = (index, time.perf_counter())
        for done in client.as_completed(list(in_flight)):
            collect(done)
        elapsed = time.perf_counter() - started

    total = len(latencies) + dropped + rejected + failed
    print(
        f"\n{total} frames in {elapsed:.2f} s: {len(latencies)} results, {dropped} dropped (ring full), "
        f"{rejected} dropped (server queue full), {failed} failed"
    )
    if latencies:
        ordered = sorted(latencies)
        p50 = ordered[len(ordered) // 2] * 1e3
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3
        print(f"latency p50 {p50:.2f} ms, p99 {p99:.2f} ms, {len(latencies) / elapsed:.1f} results/s")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
