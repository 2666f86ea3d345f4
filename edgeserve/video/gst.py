"""The GStreamer path: `gst:PIPELINE`, for users whose capture is already a GStreamer pipeline.

The pipeline must end in an `appsink` (named or not); caps are forced to packed RGB, so the
pipeline needs a `videoconvert` before it. Needs GStreamer's Python bindings (PyGObject, `gi`)
importable by the Python that runs edgeserve; elsewhere a `gst:` source fails with that reason.

    edgeserve watch "gst:v4l2src device=/dev/video0 ! videoconvert ! appsink" --model centerface
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt


def available() -> str | None:
    """None when GStreamer can be used here, else why not."""
    try:
        import gi

        gi.require_version("Gst", "1.0")
        gi.require_version("GstApp", "1.0")
        from gi.repository import Gst, GstApp  # noqa: F401
    except (ImportError, ValueError) as exc:
        return f"GStreamer's Python bindings (gi, Gst 1.0, GstApp) are not importable: {exc}"
    return None


def _find_appsink(pipeline: Any, gst: Any) -> Any:
    """The pipeline's appsink, or None (a Gst.Iterator is walked by hand: it is not a Python iterable)."""
    elements = pipeline.iterate_elements()
    while True:
        result, element = elements.next()
        if result == gst.IteratorResult.RESYNC:
            elements.resync()
            continue
        if result != gst.IteratorResult.OK:
            return None
        if element.get_factory().get_name() == "appsink":
            return element


def gst_frames(
    description: str, stopping: threading.Event, read_timeout: float
) -> Iterator[tuple[npt.NDArray[np.uint8], float | None]]:
    """(RGB frame, pts in seconds) from the pipeline's appsink until EOS, an error or `stopping`."""
    problem = available()
    if problem is not None:
        raise RuntimeError(problem)
    import gi

    gi.require_version("Gst", "1.0")
    from gi.repository import Gst

    Gst.init(None)
    pipeline: Any = Gst.parse_launch(description)
    sink: Any = _find_appsink(pipeline, Gst)
    if sink is None:
        raise ValueError("the GStreamer pipeline has no appsink")
    sink.set_property("caps", Gst.Caps.from_string("video/x-raw,format=RGB"))
    sink.set_property("max-buffers", 2)
    sink.set_property("drop", True)
    pipeline.set_state(Gst.State.PLAYING)
    try:
        while not stopping.is_set():
            sample = sink.try_pull_sample(int(read_timeout * Gst.SECOND))
            if sample is None:
                if sink.is_eos():
                    return
                raise TimeoutError(f"no frame from the GStreamer pipeline in {read_timeout} s")
            structure = sample.get_caps().get_structure(0)
            width, height = structure.get_value("width"), structure.get_value("height")
            buffer = sample.get_buffer()
            ok, info = buffer.map(Gst.MapFlags.READ)
            if not ok:
                continue
            try:
                stride = len(info.data) // height
                rows = np.frombuffer(info.data, np.uint8).reshape(height, stride)
                rgb = rows[:, : width * 3].reshape(height, width, 3).copy()
            finally:
                buffer.unmap(info)
            pts = buffer.pts / Gst.SECOND if buffer.pts != Gst.CLOCK_TIME_NONE else None
            yield rgb, pts
    finally:
        pipeline.set_state(Gst.State.NULL)
