"""Clips with known content, encoded by the tests themselves (PyAV's libx264 / libx265), and the
frames to build them: a real face (Grace Hopper's portrait, public domain, in matplotlib's sample
data) moving across a plain background, and rendered text for the OCR pipeline.

Not a test module: tests/video/*.py and benchmarks/bench_video.py import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

OCR_TEXT = "EDGESERVE 2026"


def portrait(height: int) -> np.ndarray:
    """Grace Hopper's portrait (RGB) scaled to `height` rows."""
    import matplotlib
    from PIL import Image

    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    image = Image.open(path).convert("RGB")
    width = round(image.width * height / image.height)
    return np.asarray(image.resize((width, height), Image.BILINEAR))


def face_frames(
    count: int, size: tuple[int, int] = (320, 192)
) -> Iterator[tuple[np.ndarray, tuple[int, int, int, int] | None]]:
    """(frame, portrait box x1, y1, x2, y2) per frame: the portrait slides right; every 10th frame
    (index % 10 == 9) has no portrait at all (box None)."""
    width, height = size
    face = portrait(int(height * 0.9))
    fh, fw = face.shape[:2]
    top = (height - fh) // 2
    for index in range(count):
        frame = np.full((height, width, 3), 70, np.uint8)
        box = None
        if index % 10 != 9:
            left = (index * 4) % max(1, width - fw)
            frame[top : top + fh, left : left + fw] = face
            box = (left, top, left + fw, top + fh)
        yield frame, box


def text_frames(count: int, size: tuple[int, int] = (480, 160), text: str = OCR_TEXT) -> Iterator[np.ndarray]:
    from PIL import Image, ImageDraw, ImageFont

    height = size[1]
    font = ImageFont.load_default(size=height // 3)
    for index in range(count):
        image = Image.new("RGB", size, "white")
        ImageDraw.Draw(image).text((20 + index % 5, height // 3), text, fill="black", font=font)
        yield np.asarray(image)


def encode(path: Path, frames: Iterator[np.ndarray], codec: str = "libx264", fps: int = 10) -> Path:
    """Write `frames` (RGB) to `path` (the container from its suffix) with `codec`; an open GOP of
    fps frames so a cut stream recovers within a second."""
    import av

    with av.open(str(path), "w") as container:
        stream = None
        for frame in frames:
            if stream is None:
                stream = container.add_stream(codec, rate=Fraction(fps, 1))
                stream.height, stream.width = frame.shape[:2]
                stream.pix_fmt = "yuv420p"
                opts = {"preset": "ultrafast", "g": str(fps)}
                if codec == "libx265":
                    opts["x265-params"] = f"keyint={fps}:log-level=error"
                stream.options = opts
            for packet in stream.encode(
                av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            ):
                container.mux(packet)
        assert stream is not None, "no frames"
        for packet in stream.encode():
            container.mux(packet)
    return path


def corrupt(source: Path, target: Path, every: int = 2000, seed: int = 7) -> Path:
    """A copy of `source` with bytes overwritten at random all through its second half (the
    container's index at the start stays readable; the video data does not)."""
    data = bytearray(source.read_bytes())
    rng = np.random.default_rng(seed)
    start = len(data) // 2
    for offset in range(start, len(data) - 64, every):
        data[offset : offset + 48] = rng.integers(0, 256, 48, dtype=np.uint8).tobytes()
    target.write_bytes(bytes(data))
    return target


def ts_copy(source: Path, target: Path) -> Path:
    """`source` remuxed (no re-encoding) into MPEG-TS, which has no index: every packet is found by
    its sync byte, so corruption costs the damaged packets only."""
    import av

    with av.open(str(source)) as inp, av.open(str(target), "w", format="mpegts") as out:
        video = inp.streams.video[0]
        stream = out.add_stream_from_template(video)
        for packet in inp.demux(video):
            if packet.dts is None:
                continue
            packet.stream = stream
            out.mux(packet)
    return target


def quick_sources() -> Any:
    """Source options for tests: short timeouts and backoff (a stall is noticed in 2 s)."""
    from edgeserve.video import SourceOptions

    return SourceOptions(open_timeout=3.0, read_timeout=2.0, backoff_initial=0.2, backoff_max=1.0)


def face_inside(result: Any, box: tuple[int, int, int, int] | None) -> bool:
    """No face where the frame has no portrait; else one face whose box's centre lies in the
    portrait's upper half (where the face is)."""
    if box is None:
        return result.boxes == []
    if len(result.boxes) != 1:
        return False
    x1, y1, x2, y2 = result.boxes[0]
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    return bool(box[0] <= cx <= box[2] and box[1] <= cy <= (box[1] + box[3]) / 2)


def expected_boxes(count: int, size: tuple[int, int] = (320, 192)) -> list[tuple[int, int, int, int] | None]:
    return [b for _, b in face_frames(count, size)]
