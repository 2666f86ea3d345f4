"""The watch pipeline: N sources -> flow control -> one model on the local appliance -> results out.

    from edgeserve.video import Watch, WatchOptions, parse_sources
    watch = Watch(parse_sources(["cam=rtsp://127.0.0.1:8554/cam", "clip.mp4"]),
                  WatchOptions(model="centerface"), on_result=lambda r: print(r.stream, r.boxes))
    watch.run()                     # until every source ends, or watch.stop() (any thread)

Threads: one decoder per source (PyAV; FFmpeg decodes without the GIL), which also converts the
frames that will be sent straight into the stream's free ring slots (flow.py: while the pixels are
in cache, and off the event loop), and one asyncio loop (the caller's thread) that owns the ZeroMQ
client, hands free slots to the decoders, sends the converted frames and takes the results. In the
steady state a frame costs the loop two turns: the decoder's call sends it (`_pump`, while the
stream's task is parked) and the reply's callback reads the outputs in place and frees the slot.
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
from typing import Any

from edgeserve.client._core import InferResult
from edgeserve.client.aio import AsyncZmqClient, Reply
from edgeserve.client.errors import ClientError
from edgeserve.client.ring import FrameRing
from edgeserve.video.convert import InputError, InputSpec
from edgeserve.video.flow import HOT_WAIT, Converter, Mailbox, Ready, converter
from edgeserve.video.metrics import VideoCollector
from edgeserve.video.options import WatchError, WatchOptions
from edgeserve.video.publish import CallbackSink, Sink
from edgeserve.video.results import CENTERFACE_OUTPUTS, Result, interpret
from edgeserve.video.sources import Decoded, SourceSpec, SourceThread
from edgeserve.video.stream import Place, Stream

log = logging.getLogger("edgeserve.video")


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
        self._convert: Converter | None = None
        self._client: AsyncZmqClient | None = None
        self._outputs: list[str] | None = None
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
            self._client, self._outputs = client, outputs
            self._convert = converter(self.input, options.size)
            for stream in self.streams:
                self._start(stream)
            self.started.set()
            await asyncio.gather(*(self._serve(client, s, outputs) for s in self.streams))
        finally:
            for stream in self.streams:
                if hasattr(stream, "thread"):
                    stream.thread.stop()
                    stream.mailbox.close()
                    stream.release_held()
                if stream.overlay is not None:
                    stream.overlay.close()
            self._client = None
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
                    f"unknown model '{options.model}' at {client.endpoint}: {exc.message}"
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
                loop.call_soon_threadsafe(self._pump, stream)

        stream.mailbox = Mailbox(stream.policy, self.options.fps, wake, self._convert)

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
        mailbox = stream.mailbox
        while True:
            stream.wake.clear()
            deferred, stream.deferred = stream.deferred, []
            for ready in deferred + mailbox.take_ready():
                await self._send(client, stream, ready, outputs)
            await self._fill(client, stream, outputs)
            stopped = self._stopping or stream.thread.stopping.is_set()
            drained = stream.ended and not mailbox.waiting
            if (stopped or drained) and stream.inflight == 0:
                stream.release_held()
                return
            mailbox.hush(stream.inflight >= self.options.inflight)
            stream.parked = True
            try:
                await stream.wake.wait()
            finally:
                stream.parked = False

    def _pump(self, stream: Stream) -> None:
        """The decoder has news (a converted frame, or one kept unconverted). While the stream's
        task is parked, converted frames are sent from here, which saves a turn of the event loop
        to wake the task; anything else (a frame to convert here, the client has to wait, the
        stream stops) is the task's."""
        client = self._client
        if not stream.parked or client is None:
            stream.wake.set()
            return
        ready = stream.mailbox.take_ready()
        for index, each in enumerate(ready):
            if not self._send_now(client, stream, each):
                stream.deferred.extend(ready[index:])
                stream.wake.set()
                return
        if not self._handed_on(stream):
            stream.wake.set()
            return
        stream.mailbox.hush(stream.inflight >= self.options.inflight)

    def _handed_on(self, stream: Stream) -> bool:
        """The stream's free slots went to its decoder and its task has nothing to do (not
        stopping, nothing waiting to be converted here)."""
        return not (self._stopping or stream.ended or stream.thread.stopping.is_set()) and self._give(stream)

    async def _fill(self, client: AsyncZmqClient, stream: Stream, outputs: list[str] | None) -> None:
        """Use the stream's free slots: each goes to the decoder for the next frame, or takes the
        frame that waited (see flow.py)."""
        mailbox = stream.mailbox
        while not self._stopping and not self._give(stream):
            if self._at_limit(stream):
                stream.thread.stop()
                mailbox.close()
                return
            for slot in mailbox.reclaim():  # this frame goes first (it may also have outgrown them)
                slot.release()
            item = mailbox.take()
            if item is None:
                return
            await self._send_waiting(client, stream, item, outputs)

    def _give(self, stream: Stream) -> bool:
        """Hand the stream's free slots to its decoder; False when the loop has to act: convert the
        frame that waited, or stop the stream at its --max-frames."""
        mailbox, inflight = stream.mailbox, self.options.inflight
        if self._at_limit(stream):
            return False
        if mailbox.unconverted and not self._hot(stream):
            return stream.inflight >= inflight
        while stream.rings and stream.inflight + mailbox.held < inflight:
            slot = stream.rings[-1][0].try_acquire()
            if slot is None:
                break
            mailbox.give(slot)
        return True

    def _at_limit(self, stream: Stream) -> bool:
        limit = self.options.max_frames
        return bool(limit) and stream.stats.inferred + stream.stats.failed + stream.inflight >= limit

    def _hot(self, stream: Stream) -> bool:
        """Leave the frame that waited for the next one, converted by the decoder (flow.py)? Only
        while another frame of the stream is at the server: the model is not kept waiting for it."""
        mailbox = stream.mailbox
        return (
            stream.policy == "latest"
            and stream.inflight > 0
            and mailbox.feeding
            and not stream.ended
            and mailbox.due_in() <= HOT_WAIT
        )

    async def _send_waiting(
        self, client: AsyncZmqClient, stream: Stream, item: Decoded, outputs: list[str] | None
    ) -> None:
        """A frame that waited unconverted: converted here (after new rings, if it outgrew them)."""
        spec, convert = self.input, self._convert
        assert spec is not None and convert is not None
        width, height = spec.size_for(item.width, item.height, self.options.size)
        ring = await self._rings(client, stream, spec.byte_size(width, height), outputs)
        stream.mailbox.feed()
        slot = ring.try_acquire()
        ready = convert(item, slot) if slot is not None else None
        if ready is None:
            stream.stats.rejected += 1
            return
        await self._send(client, stream, ready, outputs)

    def _request(
        self, stream: Stream, ready: Ready, outputs: list[str] | None
    ) -> tuple[dict[str, Any], Any] | None:
        """The inputs and outputs of the request for a converted frame; None (its slot given
        back) when it is not to be sent."""
        spec = self.input
        assert spec is not None
        stream.convert_cpu_s += ready.cpu_s
        ready.cpu_s = 0.0  # counted once, if it waits for a second try
        slot, item = ready.slot, ready.item
        # at --max-frames already (a slot given to the decoder before the limit was reached, whose
        # frame came in after it: on a busy box the 11th of 10 was sent)
        stopped = self._stopping or stream.thread.stopping.is_set() or self._at_limit(stream)
        if ready.error is not None or stopped:
            slot.release()
            if ready.error is not None:
                stream.stats.failed += 1
                log.warning(
                    "stream %s: frame %d not converted: %s", stream.spec.name, item.index, ready.error
                )
            return None
        out_ring = stream.out_ring(slot.ring)
        if out_ring is not None and out_ring.free < len(outputs or ()):
            slot.release()  # output slots of timed-out requests are still quarantined
            stream.stats.rejected += 1
            return None
        wanted: Any = {name: out_ring for name in outputs or ()} if out_ring is not None else outputs
        return {spec.name: ready.tensor}, wanted

    async def _send(
        self, client: AsyncZmqClient, stream: Stream, ready: Ready, outputs: list[str] | None
    ) -> None:
        request = self._request(stream, ready, outputs)
        if request is None:
            return
        stream.inflight += 1
        place = stream.sent()
        try:
            await client.submit_to(
                self._reply(stream, ready, place), self.options.model, *request, version=self.options.version
            )
        except ClientError as exc:
            stream.inflight -= 1
            stream.failed(exc)
            self._publish(stream, stream.answered(place, None))

    def _send_now(self, client: AsyncZmqClient, stream: Stream, ready: Ready) -> bool:
        """`_send` without waiting; False (the frame not sent, its slot kept) when the client
        would have to wait."""
        request = self._request(stream, ready, self._outputs)
        if request is None:
            return True
        place = Place()  # in the stream's order once sent (its reply cannot come before)
        reply = self._reply(stream, ready, place)
        try:
            sent = client.submit_now(reply, self.options.model, *request, version=self.options.version)
        except ClientError as exc:
            stream.failed(exc)
            return True
        if sent:
            stream.inflight += 1
            stream.sent(place)
        return sent

    def _reply(self, stream: Stream, ready: Ready, place: Place) -> Reply:
        return functools.partial(self._done, stream, ready.item, ready.size, place)

    async def _rings(
        self, client: AsyncZmqClient, stream: Stream, size: int, outputs: list[str] | None
    ) -> FrameRing:
        """The stream's input ring (with, when the outputs are named ones known to be smaller than
        the input, CenterFace's maps: 5/16 of its size, an output ring, so that they come back
        through shared memory as well; other outputs come inline)."""
        if stream.rings and stream.rings[-1][0].slot_size >= size:
            return stream.rings[-1][0]
        # The first frame, or a source that came back larger: new rings (the old ones are closed
        # with the client, once their slots are back).
        for slot in stream.mailbox.reclaim():
            slot.release()
        name = f"watch-{stream.spec.name}-{os.getpid()}-{len(stream.rings)}"
        inflight = self.options.inflight
        ring = await client.create_ring(inflight, size, name=name)
        out_ring = (
            await client.create_ring(inflight * len(outputs), size, name=f"{name}-out") if outputs else None
        )
        stream.rings.append((ring, out_ring))
        return ring

    def _done(
        self,
        stream: Stream,
        item: Decoded,
        sent: tuple[int, int],
        place: Place,
        reply: InferResult | None,
        error: ClientError | None,
    ) -> None:
        """A frame's reply (from the client's reader callback: the outputs are views of their ring
        slots, read here and given back after)."""
        stream.inflight -= 1
        stream.mailbox.hush(False)
        # The freed slot goes straight to the decoder; the stream's task wakes only when it has to act.
        if not self._handed_on(stream):
            stream.wake.set()
        answer = None
        if error is not None:
            stream.failed(error)
        elif reply is not None:
            data = interpret(reply.outputs, sent, (item.width, item.height), self.options.threshold)
            latency = time.perf_counter() - item.t0
            stream.stats.observe(latency)
            name, model = stream.spec.name, self.options.model
            result = Result(
                name, item.index, item.pts, item.wall, latency * 1e3, model, item.width, item.height, data
            )
            answer = (result, item.frame)
        self._publish(stream, stream.answered(place, answer))

    def _publish(self, stream: Stream, answers: list[tuple[Result, Any]]) -> None:
        for result, frame in answers:
            payload = result.to_json() if any(not isinstance(s, CallbackSink) for s in self.sinks) else b""
            for sink in self.sinks:
                sink.publish(result, payload)
            if stream.overlay is not None:
                stream.overlay.put(frame, result)


class _suppress_closed:
    """call_soon_threadsafe on a loop that just closed (the watch ended meanwhile) is harmless."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, value: object, tb: object) -> bool:
        return isinstance(value, RuntimeError)
