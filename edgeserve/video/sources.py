"""Video sources: what a SOURCE argument names, and the thread that decodes it with FFmpeg (PyAV).

    parse_source("front=rtsp://10.0.0.7/stream1")   # named stream, live, reconnected with backoff
    parse_source("clip.mp4")                        # a file: every frame, ends at its end
    parse_source("/dev/video0")                     # a V4L2 camera
    parse_source("gst:videotestsrc ! videoconvert ! appsink")   # a GStreamer pipeline (gst.py)

A live source that fails (refused, stalled past the read timeout, closed, too much corrupt data) is
opened again after a backoff that doubles from 0.5 s to 10 s and resets once frames flow again; it
never blocks the other streams (each source has its own thread, its own mailbox and its own slots).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("edgeserve.video")

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
NETWORK_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "udp", "tcp", "srt", "rtp")
PACE_STEP = 0.1  # s: longest sleep between stop checks while pacing a file in real time
CONSECUTIVE_CORRUPT_MAX = 25  # packets in a row the decoder refused: reconnect (live) / give up (file)


class SourceError(ValueError):
    """A SOURCE that cannot work as given (bad URL, missing file or device): exit 2 in the CLI."""


@dataclass(frozen=True)
class SourceSpec:
    """One stream: `name` (its id in results, topics and metrics), `url` (what FFmpeg opens),
    `kind` (file, network, v4l2, gst) and whether it is live (reconnected, latest-frame default)."""

    name: str
    url: str
    kind: str
    live: bool

    @property
    def display(self) -> str:
        """The URL without credentials (for logs and results)."""
        parts = urlsplit(self.url)
        if parts.password is None and parts.username is None:
            return self.url
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return parts._replace(netloc=f"***@{host}{port}").geturl()


def parse_source(text: str, index: int = 0) -> SourceSpec:
    """`[NAME=]URL|PATH|/dev/videoN|gst:PIPELINE` -> SourceSpec; SourceError names what is wrong."""
    name = f"stream{index}"
    head, sep, rest = text.partition("=")
    if sep and NAME_RE.match(head) and "://" not in head and not head.startswith("gst:"):
        name, text = head, rest
    if not text:
        raise SourceError(f"source {name!r}: empty")
    if text.startswith("gst:"):
        if not text[4:].strip():
            raise SourceError(f"source {name!r}: 'gst:' needs a pipeline ending in an appsink")
        return SourceSpec(name, text[4:].strip(), "gst", True)
    if text.startswith("v4l2://"):
        text = text[len("v4l2://") :]
        if not text.startswith("/dev/"):
            raise SourceError(f"source {name!r}: v4l2:// needs a device path, e.g. v4l2:///dev/video0")
    if text.startswith("/dev/video"):
        if not Path(text).exists():
            raise SourceError(f"source {name!r}: no such V4L2 device {text}")
        return SourceSpec(name, text, "v4l2", True)
    scheme = urlsplit(text).scheme.lower() if "://" in text else ""
    if scheme == "file":
        text, scheme = urlsplit(text).path, ""
    if scheme:
        if scheme not in NETWORK_SCHEMES:
            known = ", ".join(f"{s}://" for s in NETWORK_SCHEMES)
            raise SourceError(
                f"source {name!r}: unsupported URL scheme {scheme}:// (known: {known}, "
                "file paths, /dev/videoN, gst:PIPELINE)"
            )
        if not urlsplit(text).hostname:
            raise SourceError(f"source {name!r}: {text!r} names no host")
        return SourceSpec(name, text, "network", True)
    path = Path(text)
    if not path.is_file():
        raise SourceError(f"source {name!r}: no such file {text}")
    return SourceSpec(name, str(path), "file", False)


def parse_sources(texts: list[str]) -> list[SourceSpec]:
    specs = [parse_source(t, i) for i, t in enumerate(texts)]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SourceError(f"stream names must be unique; repeated: {', '.join(duplicates)}")
    return specs


@dataclass(slots=True)
class Decoded:
    """A decoded frame on its way to the model. `frame` is the PyAV VideoFrame (or, from GStreamer,
    an RGB ndarray); `pts` in seconds (None when unknown); `wall` is the decode time (time.time())
    and `t0` the same moment on perf_counter (for latency)."""

    frame: Any
    index: int
    pts: float | None
    wall: float
    t0: float
    width: int
    height: int


@dataclass
class SourceOptions:
    rtsp_transport: str = "tcp"
    open_timeout: float = 10.0
    read_timeout: float = 5.0  # no data for this long: the stream is stalled, reconnect
    realtime: bool = False  # play files at their own pace (a camera stand-in)
    loop: bool = False  # start files again at their end
    backoff_initial: float = 0.5
    backoff_max: float = 10.0
    decoder_threads: int = 0  # 0: FFmpeg picks


@dataclass
class SourceCounters:
    decoded: int = 0
    corrupt: int = 0
    reconnects: int = 0
    decode_cpu_s: float = 0.0  # this thread's CPU time in FFmpeg's demuxer and decoder
    up: bool = False
    last_error: str = ""
    extra: dict[str, int] = field(default_factory=dict)


class Backoff:
    """0.5, 1, 2, 4 ... 10 s with +-20% jitter (many cameras behind one switch do not retry in step)."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial, self.maximum = initial, maximum
        self.current = initial

    def next(self) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.maximum, self.current * 2)
        return delay

    def reset(self) -> None:
        self.current = self.initial


class SourceThread(threading.Thread):
    """Opens, decodes and reopens one source; each frame goes to `emit` (which may block: the
    every-frame policy's backpressure). `on_end` runs once when the thread finishes."""

    def __init__(
        self,
        spec: SourceSpec,
        options: SourceOptions,
        emit: Callable[[Decoded], None],
        on_end: Callable[[str | None], None],
    ) -> None:
        super().__init__(name=f"video-{spec.name}", daemon=True)
        self.spec, self.options, self.emit, self.on_end = spec, options, emit, on_end
        self.counters = SourceCounters()
        self.stopping = threading.Event()
        self._index = 0

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        error: str | None = None
        try:
            error = self._run()
        except Exception as exc:  # a bug here must end this stream, never the others
            log.exception("stream %s: decoder failed", self.spec.name)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.counters.up = False
            self.on_end(error)

    def _run(self) -> str | None:
        backoff = Backoff(self.options.backoff_initial, self.options.backoff_max)
        while not self.stopping.is_set():
            try:
                for decoded in self._frames():
                    if not self.counters.up:
                        self.counters.up = True
                        backoff.reset()
                    self.emit(decoded)
                    if self.stopping.is_set():
                        return None
                if not self.spec.live and not self.options.loop:
                    return None
                if not self.spec.live:
                    continue
                problem = "the stream ended"
            except Exception as exc:  # av.FFmpegError, OSError, a stall (TimeoutError) ...
                if self.stopping.is_set():
                    return None  # a read that stop() cut short: no loss to count
                # FFmpeg's errors quote the URL: never with its password (logs, metrics, stderr)
                problem = f"{type(exc).__name__}: {exc}".strip().replace(self.spec.url, self.spec.display)
                if not self.spec.live:
                    return f"{self.spec.display}: {problem}"
            if self.stopping.is_set():
                return None  # the frames ended because stop() asked: not the camera's doing
            self.counters.up = False
            self.counters.last_error = problem
            self.counters.reconnects += 1
            delay = backoff.next()
            log.warning(
                "stream %s (%s): %s; reconnecting in %.1f s",
                self.spec.name,
                self.spec.display,
                problem,
                delay,
            )
            if self.stopping.wait(delay):
                return None
        return None

    def _frames(self) -> Iterator[Decoded]:
        if self.spec.kind == "gst":
            from edgeserve.video.gst import gst_frames

            for rgb, pts in gst_frames(self.spec.url, self.stopping, self.options.read_timeout):
                yield self._decoded(rgb, pts, rgb.shape[1], rgb.shape[0])
            return
        yield from self._av_frames()

    def _decoded(self, frame: Any, pts: float | None, width: int, height: int) -> Decoded:
        self.counters.decoded += 1
        self._index += 1
        return Decoded(frame, self._index - 1, pts, time.time(), time.perf_counter(), width, height)

    def _sleep_until(self, deadline: float) -> bool:
        """Wait for a frame's time (--realtime); False when stopped meanwhile. time.sleep, in
        steps that keep stop() prompt: half the CPU of Event.wait's lock per frame."""
        while True:
            wait = deadline - time.perf_counter()
            if self.stopping.is_set():
                return False
            if wait <= 0:
                return True
            time.sleep(min(wait, PACE_STEP))

    def _av_frames(self) -> Iterator[Decoded]:
        import av

        container = av.open(self.spec.url, **open_arguments(self.spec, self.options))
        try:
            stream = container.streams.video[0]
            if self.options.decoder_threads == 1:
                stream.codec_context.thread_count = 1  # decoded in this thread (its CPU is counted)
            else:
                stream.thread_type = "AUTO"
                stream.codec_context.thread_count = self.options.decoder_threads
            time_base = float(stream.time_base) if stream.time_base else None
            pace = self.spec.kind == "file" and self.options.realtime
            started, first_pts = time.perf_counter(), None
            bad_in_a_row = 0
            cpu = time.thread_time()
            for packet in container.demux(stream):
                if self.stopping.is_set():
                    return
                stamp = packet.dts if packet.dts is not None else packet.pts
                if pace and stamp is not None and time_base:
                    # a camera stand-in: each packet arrives at its time and is decoded at once
                    first_pts = stamp * time_base if first_pts is None else first_pts
                    self.counters.decode_cpu_s += time.thread_time() - cpu
                    if not self._sleep_until(started + (stamp * time_base - first_pts)):
                        return
                    cpu = time.thread_time()
                if packet.is_corrupt:  # the demuxer saw damage (e.g. MPEG-TS continuity errors)
                    self.counters.corrupt += 1
                try:
                    frames = packet.decode()
                except av.error.InvalidDataError:
                    self.counters.corrupt += 1
                    bad_in_a_row += 1
                    if bad_in_a_row > CONSECUTIVE_CORRUPT_MAX:
                        raise
                    continue
                bad_in_a_row = 0
                now = time.thread_time()
                self.counters.decode_cpu_s += now - cpu
                cpu = now
                for frame in frames:
                    if frame.is_corrupt:  # decoded with concealment: still a picture, counted
                        self.counters.corrupt += 1
                    pts = frame.pts * time_base if frame.pts is not None and time_base else None
                    yield self._decoded(frame, pts, frame.width, frame.height)
                cpu = time.thread_time()  # not the time the frame's consumer took
        finally:
            container.close()


def open_arguments(spec: SourceSpec, options: SourceOptions) -> dict[str, Any]:
    """av.open keyword arguments: FFmpeg options per kind, and PyAV's own open/read timeouts (its
    interrupt callback, which also ends a read from a stalled TCP connection)."""
    ffmpeg: dict[str, str] = {}
    arguments: dict[str, Any] = {"timeout": (options.open_timeout, options.read_timeout)}
    if spec.kind == "v4l2":
        arguments["format"] = "video4linux2"
    if spec.url.startswith(("rtsp://", "rtsps://")):
        ffmpeg["rtsp_transport"] = options.rtsp_transport
        ffmpeg["timeout"] = str(int(options.read_timeout * 1e6))  # socket I/O, microseconds
    if spec.live:
        ffmpeg["fflags"] = "nobuffer"  # a live camera: do not queue frames behind the decoder
    arguments["options"] = ffmpeg
    return arguments
