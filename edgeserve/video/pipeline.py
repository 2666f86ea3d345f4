"""The watch pipeline: N sources -> flow control -> one model on the local appliance -> results out.

    from edgeserve.video import Watch, WatchOptions, parse_sources
    watch = Watch(parse_sources(["cam=rtsp://127.0.0.1:8554/cam", "clip.mp4"]),
                  WatchOptions(model="centerface"), on_result=lambda r: print(r.stream, r.boxes))
    watch.run()                     # until every source ends, or watch.stop() (any thread)

Threads: one decoder per source (PyAV; FFmpeg decodes without the GIL) and one asyncio loop (the
caller's thread) that owns the ZeroMQ client, converts each frame it sends into a ring slot (swscale
and numpy release the GIL; a hand-off to a pool cost more CPU than it saved), and takes results.
Each stream has its own ring of `inflight` slots, which is its fair share: a fast camera cannot
take the slots of a slow one, and frames of all streams meet in the model's dynamic batcher. A
stream's failures (reconnects, corrupt data, rejected requests) stay in that stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgeserve.client.aio import AsyncZmqClient
from edgeserve.client.errors import ClientError
from edgeserve.client.ring import FrameRing
from edgeserve.client.zmq_client import DEFAULT_ENDPOINT
from edgeserve.video.convert import InputError, InputSpec, write_input
from edgeserve.video.flow import Mailbox
from edgeserve.video.metrics import StreamStats, VideoCollector
from edgeserve.video.publish import CallbackSink, Sink
from edgeserve.video.results import CENTERFACE_OUTPUTS, Result, interpret
from edgeserve.video.sources import Decoded, SourceOptions, SourceSpec, SourceThread

log = logging.getLogger("edgeserve.video")


class WatchError(Exception):
    """The model cannot be watched as asked (unknown model, not an image model): exit 2."""


@dataclass
class WatchOptions:
    model: str
    version: str = ""
    endpoint: str = DEFAULT_ENDPOINT
    policy: str | None = None  # None: latest for live sources, every for files
    fps: float | None = None
    # Requests in flight per stream (its ring's slots). 0: 2 for a single stream (the next frame
    # waits at the server while one runs), 1 for several (the other streams keep the model busy,
    # and a frame queued behind its own stream's is a stale one).
    inflight: int = 0
    size: tuple[int, int] | None = None  # (width, height) for dynamic model inputs
    scale: float = 1.0
    bgr: bool = False
    threshold: float = 0.5
    timeout: float = 10.0
    max_frames: int = 0  # results per stream, then that stream stops (0 = no limit)
    source: SourceOptions = field(default_factory=SourceOptions)


class Stream:
    def __init__(self, spec: SourceSpec, policy: str) -> None:
        self.spec, self.policy = spec, policy
        self.stats = StreamStats()
        self.mailbox: Mailbox
        self.thread: SourceThread
        self.wake = asyncio.Event()
        self.rings: list[tuple[FrameRing, FrameRing | None]] = []
        self.inflight = 0
        self.ended = False
        self.error: str | None = None
        self.convert_cpu_s = 0.0
        self.overlay: Any = None

    def snapshot(self) -> tuple[str, int, dict[str, int], int, int, bool, StreamStats]:
        c = self.thread.counters
        dropped = {**self.mailbox.dropped, "server": self.stats.rejected, "failed": self.stats.failed}
        return (self.spec.name, c.decoded, dropped, c.corrupt, c.reconnects, c.up, self.stats)


class Watch:
    def __init__(
        self,
        sources: Sequence[SourceSpec],
        options: WatchOptions,
        *,
        sinks: Iterable[Sink] = (),
        on_result: Callable[[Result], Any] | None = None,
        overlay: Callable[[SourceSpec], Any] | None = None,
    ) -> None:
        if not sources:
            raise ValueError("no sources")
        self.sinks = list(sinks) + ([CallbackSink(on_result)] if on_result is not None else [])
        if not options.inflight:
            options = dataclasses.replace(options, inflight=2 if len(sources) == 1 else 1)
        if not options.source.decoder_threads and len(sources) >= (os.cpu_count() or 1):
            # As many streams as cores: one decoder thread each (FFmpeg's frame threads would add
            # a frame of latency and context switches per stream for no more throughput).
            options = dataclasses.replace(
                options, source=dataclasses.replace(options.source, decoder_threads=1)
            )
        self.options = options
        self.streams = [Stream(s, options.policy or ("latest" if s.live else "every")) for s in sources]
        self._overlay_factory = overlay
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.collector = VideoCollector(lambda: [s.snapshot() for s in self.streams if hasattr(s, "thread")])
        self.input: InputSpec | None = None
        self.started = threading.Event()

    # -- public ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Blocks until every stream ended (or `stop()`); returns how many streams ended in error."""
        return asyncio.run(self.main())

    def stop(self) -> None:
        """Stop from any thread (or a signal handler): results in flight still arrive, then run() returns."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with _suppress_closed():
                loop.call_soon_threadsafe(self._stop)

    async def main(self) -> int:
        self._loop = asyncio.get_running_loop()
        for stream in self.streams:
            stream.wake = asyncio.Event()
        options = self.options
        client = AsyncZmqClient(options.endpoint, timeout=options.timeout)
        try:
            self.input, outputs = await self._model(client)
            for stream in self.streams:
                self._start(stream)
            self.started.set()
            await asyncio.gather(*(self._serve(client, s, outputs) for s in self.streams))
        finally:
            for stream in self.streams:
                if hasattr(stream, "thread"):
                    stream.thread.stop()
                    stream.mailbox.close()
                if stream.overlay is not None:
                    stream.overlay.close()
            await client.close()
            for sink in self.sinks:
                sink.close()
        return sum(1 for s in self.streams if s.error)

    # -- internals ------------------------------------------------------------------------------
    async def _model(self, client: AsyncZmqClient) -> tuple[InputSpec, list[str] | None]:
        options = self.options
        try:
            meta = await client.metadata(options.model, options.version)
        except ClientError as exc:
            if exc.status in ("NOT_FOUND", "INVALID_ARG"):
                raise WatchError(
                    f"unknown model '{options.model}' at {options.endpoint}: {exc.message}"
                ) from None
            raise
        try:
            spec = InputSpec.from_metadata(meta, bgr=options.bgr, scale=options.scale)
        except InputError as exc:
            raise WatchError(str(exc)) from None
        names = [o["name"] for o in meta.get("outputs", [])]
        # CenterFace's landmarks are 10 maps the results do not use: not sent back at all.
        outputs = list(CENTERFACE_OUTPUTS) if all(n in names for n in CENTERFACE_OUTPUTS) else None
        return spec, outputs

    def _start(self, stream: Stream) -> None:
        loop = self._loop
        assert loop is not None

        def wake() -> None:
            with _suppress_closed():
                loop.call_soon_threadsafe(stream.wake.set)

        stream.mailbox = Mailbox(stream.policy, self.options.fps, wake)

        def ended(error: str | None) -> None:
            with _suppress_closed():
                loop.call_soon_threadsafe(self._ended, stream, error)

        stream.thread = SourceThread(stream.spec, self.options.source, stream.mailbox.offer, ended)
        if self._overlay_factory is not None:
            stream.overlay = self._overlay_factory(stream.spec)
        stream.thread.start()

    def _ended(self, stream: Stream, error: str | None) -> None:
        stream.ended = True
        stream.error = error
        if error:
            log.error("stream %s: %s", stream.spec.name, error)
        stream.wake.set()

    def _stop(self) -> None:
        self._stopping = True
        for stream in self.streams:
            if hasattr(stream, "thread"):
                stream.thread.stop()
                stream.mailbox.close()
            stream.wake.set()

    async def _serve(
        self,
        client: AsyncZmqClient,
        stream: Stream,
        outputs: list[str] | None,
    ) -> None:
        limit = self.options.max_frames
        while True:
            stream.wake.clear()
            while stream.inflight < self.options.inflight and not self._stopping:
                if limit and stream.stats.inferred + stream.stats.failed + stream.inflight >= limit:
                    stream.thread.stop()
                    stream.mailbox.close()
                    break
                item = stream.mailbox.take()
                if item is None:
                    break
                await self._send(client, stream, item, outputs)
            stopped = self._stopping or stream.thread.stopping.is_set()
            drained = stream.ended and not stream.mailbox.waiting
            if (stopped or drained) and stream.inflight == 0:
                return
            await stream.wake.wait()

    async def _send(
        self,
        client: AsyncZmqClient,
        stream: Stream,
        item: Decoded,
        outputs: list[str] | None,
    ) -> None:
        spec = self.input
        assert spec is not None
        width, height = spec.size_for(item.width, item.height, self.options.size)
        ring, out_ring = await self._rings(client, stream, spec.byte_size(width, height), outputs)
        slot = ring.try_acquire()
        if slot is None or (out_ring is not None and out_ring.free < len(outputs or ())):
            if slot is not None:  # output slots of timed-out requests are still quarantined
                slot.release()
            stream.stats.rejected += 1
            return
        cpu = time.thread_time()
        try:
            tensor = write_input(item.frame, slot, spec, width, height)
        except Exception as exc:
            slot.release()
            stream.stats.failed += 1
            log.warning("stream %s: frame %d not converted: %s", stream.spec.name, item.index, exc)
            return
        finally:
            stream.convert_cpu_s += time.thread_time() - cpu
        stream.inflight += 1
        wanted: Any = {name: out_ring for name in outputs or ()} if out_ring is not None else outputs
        try:
            future = await client.submit(
                self.options.model, {spec.name: tensor}, wanted, version=self.options.version
            )
        except ClientError as exc:
            stream.inflight -= 1
            self._failed(stream, exc)
            return
        future.add_done_callback(functools.partial(self._done, stream, item, (width, height)))

    async def _rings(
        self, client: AsyncZmqClient, stream: Stream, size: int, outputs: list[str] | None
    ) -> tuple[FrameRing, FrameRing | None]:
        """The stream's input ring, and an output ring when the outputs are named ones known to
        be smaller than the input (CenterFace's maps: 5/16 of its size), so that they come back
        through shared memory as well; other outputs come inline."""
        if stream.rings and stream.rings[-1][0].slot_size >= size:
            return stream.rings[-1]
        # The first frame, or a source that came back larger: new rings (the old ones are closed
        # with the client, once their slots are back).
        name = f"watch-{stream.spec.name}-{os.getpid()}-{len(stream.rings)}"
        inflight = self.options.inflight
        ring = await client.create_ring(inflight, size, name=name)
        out_ring = (
            await client.create_ring(inflight * len(outputs), size, name=f"{name}-out") if outputs else None
        )
        stream.rings.append((ring, out_ring))
        return ring, out_ring

    def _failed(self, stream: Stream, exc: BaseException) -> None:
        if isinstance(exc, ClientError) and exc.status in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
            stream.stats.rejected += 1
        else:
            stream.stats.failed += 1
        if stream.stats.failed + stream.stats.rejected <= 3 or log.isEnabledFor(logging.DEBUG):
            log.warning("stream %s: request failed: %s", stream.spec.name, exc)

    def _done(
        self, stream: Stream, item: Decoded, sent: tuple[int, int], future: asyncio.Future[Any]
    ) -> None:
        stream.inflight -= 1
        stream.wake.set()
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self._failed(stream, exc)
            return
        outputs = future.result().outputs
        data = interpret(outputs, sent, (item.width, item.height), self.options.threshold)
        latency = time.perf_counter() - item.t0
        stream.stats.observe(latency)
        result = Result(
            stream.spec.name,
            item.index,
            item.pts,
            item.wall,
            latency * 1e3,
            self.options.model,
            item.width,
            item.height,
            data,
        )
        payload = result.to_json() if any(not isinstance(s, CallbackSink) for s in self.sinks) else b""
        for sink in self.sinks:
            sink.publish(result, payload)
        if stream.overlay is not None:
            stream.overlay.put(item.frame, result)


class _suppress_closed:
    """call_soon_threadsafe on a loop that just closed (the watch ended meanwhile) is harmless."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, value: object, tb: object) -> bool:
        return isinstance(value, RuntimeError)
