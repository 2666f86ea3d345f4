"""`--overlay out.mp4`: each inferred frame with its boxes and text drawn, encoded as H.264 (PyAV).

One file per stream (`out.mp4` for one stream, `out-<stream>.mp4` for several), written by its own
thread so encoding never holds up results; the file keeps the source's timing (pts). If the
encoder falls behind, frames are left out of the overlay (counted), never out of the results.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.video.convert import rgb_of
from edgeserve.video.results import Result
from edgeserve.video.sources import SourceSpec

log = logging.getLogger("edgeserve.video")
COLOURS = ((255, 64, 64), (64, 200, 255), (255, 200, 0), (120, 255, 120))


def overlay_path(base: Path, spec: SourceSpec, streams: int) -> Path:
    return base if streams == 1 else base.with_name(f"{base.stem}-{spec.name}{base.suffix or '.mp4'}")


def draw(rgb: npt.NDArray[np.uint8], result: Result) -> npt.NDArray[np.uint8]:
    """A copy of `rgb` with the result's boxes (and labels, scores or text) drawn on it."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.fromarray(rgb)
    pen = ImageDraw.Draw(image)
    size = max(14, rgb.shape[0] // 24)
    font = ImageFont.load_default(size=size)
    data = result.data
    texts = data.get("text") or data.get("labels") or []
    for i, box in enumerate(data.get("boxes", [])):
        colour = COLOURS[i % len(COLOURS)]
        points = [tuple(p) for p in box] if isinstance(box[0], list) else None
        if points is not None:
            pen.polygon(points, outline=colour, width=3)
            x, y = points[0]
        else:
            x, y = box[0], box[1]
            pen.rectangle(box, outline=colour, width=3)
        score = data.get("scores", [])[i] if i < len(data.get("scores", [])) else None
        label = f"{texts[i] if i < len(texts) else ''} {score:.2f}" if score is not None else str(texts[i])
        pen.text(
            (x, max(0, y - size - 4)),
            label.strip(),
            fill=colour,
            font=font,
            stroke_width=2,
            stroke_fill=(0, 0, 0),
        )
    pen.text(
        (8, 8),
        f"{result.stream} #{result.frame}  {result.latency_ms:.0f} ms",
        fill=(255, 255, 255),
        font=font,
        stroke_width=2,
        stroke_fill=(0, 0, 0),
    )
    return np.asarray(image)


class OverlayWriter:
    def __init__(self, path: Path, depth: int = 32) -> None:
        self.path = path
        self.skipped = 0
        self.written = 0
        self._queue: queue.Queue[tuple[Any, Result] | None] = queue.Queue(depth)
        self._thread = threading.Thread(target=self._run, name=f"overlay-{path.name}", daemon=True)
        self._thread.start()

    def put(self, frame: Any, result: Result) -> None:
        try:
            self._queue.put_nowait((frame, result))
        except queue.Full:
            self.skipped += 1

    def close(self) -> None:
        with contextlib.suppress(queue.Full):  # a writer that failed no longer takes entries
            self._queue.put(None, timeout=5)
        self._thread.join(60)

    def _run(self) -> None:
        import av

        container: Any = None
        stream: Any = None
        last_pts = -1
        try:
            while (entry := self._queue.get()) is not None:
                frame, result = entry
                rgb = draw(np.ascontiguousarray(rgb_of(frame, result.width, result.height)), result)
                if container is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    container = av.open(str(self.path), "w")
                    stream = container.add_stream("libx264", rate=30)
                    stream.width, stream.height = (
                        result.width - result.width % 2,
                        result.height - result.height % 2,
                    )
                    stream.pix_fmt = "yuv420p"
                    stream.codec_context.time_base = Fraction(1, 1000)
                    stream.options = {"preset": "veryfast", "crf": "26"}
                pts = round((result.pts if result.pts is not None else result.time) * 1000)
                if pts <= last_pts:
                    pts = last_pts + 1
                last_pts = pts
                out = av.VideoFrame.from_ndarray(rgb[: stream.height, : stream.width], format="rgb24")
                out.pts, out.time_base = pts, Fraction(1, 1000)
                for packet in stream.encode(out):
                    container.mux(packet)
                self.written += 1
        except Exception:
            log.exception("overlay %s failed; no more overlay frames", self.path)
        finally:
            if container is not None:
                try:
                    for packet in stream.encode():
                        container.mux(packet)
                finally:
                    container.close()
