"""A video app over gRPC streaming: decode a file with PyAV, stream its frames through
`ModelStreamInfer` (tritonclient, unchanged), several frames in flight, results in frame order.
What a Triton-speaking app on the LAN does; on the appliance itself `edgeserve watch` (shared
memory, no protobuf) is the faster path.

    python -m edgeserve.video.grpc_stream clip.mp4 --model centerface --url 127.0.0.1:8001 --inflight 4

Prints one JSON result per frame (the schema of edgeserve/video/results.py), in frame order.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from collections.abc import Iterator
from typing import Any

from edgeserve.video.convert import InputSpec, to_array
from edgeserve.video.results import Result, interpret


def stream_video(
    path: str,
    model: str,
    url: str = "127.0.0.1:8001",
    *,
    inflight: int = 4,
    max_frames: int = 0,
    threshold: float = 0.5,
) -> Iterator[Result]:
    """Results of every frame of `path`, in frame order, with up to `inflight` requests on the stream."""
    import av
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    meta = client.get_model_metadata(model, as_json=True)
    spec = InputSpec.from_metadata(meta)
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    sent: dict[int, tuple[Any, float | None, float, tuple[int, int]]] = {}  # index -> frame facts
    done: dict[int, Any] = {}
    next_out = 0

    def collect(block: bool) -> None:
        result, error = replies.get(timeout=60) if block else replies.get_nowait()
        if error is not None:
            raise RuntimeError(f"ModelStreamInfer: {error}")
        done[int(result.get_response().id)] = result

    def ready() -> Iterator[Result]:
        nonlocal next_out
        while next_out in done:
            reply = done.pop(next_out)
            frame, pts, t0, size = sent.pop(next_out)
            outputs = {o.name: reply.as_numpy(o.name) for o in reply.get_response().outputs}
            data = interpret(outputs, size, (frame.width, frame.height), threshold)
            yield Result(
                "grpc",
                next_out,
                pts,
                time.time(),
                (time.perf_counter() - t0) * 1e3,
                model,
                frame.width,
                frame.height,
                data,
            )
            next_out += 1

    try:
        with av.open(path) as container:
            video = container.streams.video[0]
            video.thread_type = "AUTO"
            base = float(video.time_base) if video.time_base else 0.0
            for index, frame in enumerate(container.decode(video)):
                if max_frames and index >= max_frames:
                    break
                t0 = time.perf_counter()
                width, height = spec.size_for(frame.width, frame.height)
                tensor = to_array(frame, spec, width, height)
                request = grpcclient.InferInput(spec.name, list(tensor.shape), spec.datatype)
                request.set_data_from_numpy(tensor)
                while len(sent) - len(done) >= inflight:
                    collect(block=True)
                    yield from ready()
                pts = frame.pts * base if frame.pts is not None else None
                sent[index] = (frame, pts, t0, (width, height))
                client.async_stream_infer(model, [request], request_id=str(index))
        while len(sent) > len(done):
            collect(block=True)
            yield from ready()
        yield from ready()
    finally:
        client.stop_stream()
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("video")
    parser.add_argument("--model", default="centerface")
    parser.add_argument("--url", default="127.0.0.1:8001", help="the appliance's gRPC address")
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--max-frames", type=int, default=0)
    args = parser.parse_args(argv)
    for result in stream_video(
        args.video, args.model, args.url, inflight=args.inflight, max_frames=args.max_frames
    ):
        print(result.to_json().decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
