"""Decoded frame -> the model's input, written into a ring slot.

The layout comes from the model's metadata (its first input): HWC or CHW, with or without a batch
axis, UINT8 or a float type, fixed or dynamic height and width. swscale (PyAV's reformat) resizes
the frame in its own YUV format, then converts the colour, to packed RGB/BGR for HWC inputs or to
planar GBR for CHW ones; then one pass writes the slot: a copy (UINT8), or a cast (and scale) per
colour plane (float), each plane contiguous on both sides. Nothing else is allocated per frame
beyond swscale's two small outputs.

Measured per 1280x720 yuv420p frame -> 640x384 FP32 CHW (one core of this 2-vCPU box, process CPU):
resize + colour in one swscale pass to rgb24, then a transposing cast into the slot, 1.3-1.6 ms;
resize in YUV, colour to gbrp, three contiguous casts: 0.8-0.9 ms (swscale's combined pass scales
at full chroma resolution: twice the work of scaling the 4:2:0 planes first). A UINT8 CHW input (the
sample CenterFace) takes three plane copies instead of the casts: a quarter of the bytes written into
the slot, which is most of the difference while the model runs on the other core (in the pipeline,
1.0-1.1 ms per frame against 1.5-1.6 for FP32).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.client.ring import ShmTensor, Slot
from edgeserve.protocol import datatypes

DEFAULT_LONG_SIDE = 640  # dynamic float inputs (detectors): the frame scaled to fit this, keeping its shape
ALIGN = 32  # dynamic dims are rounded up to multiples of this (strided backbones need it)
# swscale's fast bilinear: 0.8 ms for 1280x720 -> 640x384 here, against 1.35 ms for its bilinear,
# with no difference a detector sees. Its context is kept per thread and geometry: a new one per
# frame (what VideoFrame.to_ndarray does) costs another 1 ms.
INTERPOLATION = "FAST_BILINEAR"
_local = threading.local()


class InputError(ValueError):
    """The model's input is not an image this pipeline can feed."""


@dataclass(frozen=True)
class InputSpec:
    """How to feed a model: its input `name` and `datatype`, `layout` ("HWC" or "CHW"), whether the
    request carries a batch axis of 1, the fixed height/width (None = dynamic), colour order and the
    factor applied to pixel values (float inputs)."""

    name: str
    datatype: str
    layout: str
    batch: bool
    height: int | None
    width: int | None
    bgr: bool = False
    scale: float = 1.0

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], *, bgr: bool = False, scale: float = 1.0) -> InputSpec:
        model = meta.get("name", "?")
        inputs = meta.get("inputs") or []
        if not inputs:
            raise InputError(f"model '{model}' has no inputs")
        first = inputs[0]
        dims = [int(d) for d in first["shape"]]
        batch = len(dims) == 4
        image = dims[1:] if batch else dims
        if len(image) != 3:
            raise InputError(
                f"model '{model}' input '{first['name']}' has shape {dims}: not an image "
                "(HWC or CHW with 3 channels, optionally with a batch axis)"
            )
        if image[-1] == 3:
            layout, (h, w) = "HWC", image[:2]
        elif image[0] == 3:
            layout, (h, w) = "CHW", image[1:]
        else:
            raise InputError(
                f"model '{model}' input '{first['name']}' has shape {dims}: no axis of 3 "
                "colour channels first or last"
            )
        datatype = str(first["datatype"])
        if datatype not in ("UINT8", "FP32", "FP16"):
            raise InputError(
                f"model '{model}' input '{first['name']}' is {datatype}: UINT8, FP32 or FP16 only"
            )
        return cls(
            first["name"], datatype, layout, batch, h if h > 0 else None, w if w > 0 else None, bgr, scale
        )

    def size_for(self, width: int, height: int, wanted: tuple[int, int] | None = None) -> tuple[int, int]:
        """The (width, height) a `width` x `height` frame is resized to: fixed dims win, then `wanted`
        (--size), then the frame's own size (an HWC UINT8 input is a picture the model resizes
        itself, e.g. the OCR pipeline) or, for a network's tensor (CHW, or float), the frame fitted
        into DEFAULT_LONG_SIDE, rounded up to ALIGN."""
        w, h = wanted if wanted is not None else (width, height)
        if wanted is None and (self.datatype != "UINT8" or self.layout == "CHW"):
            factor = min(1.0, DEFAULT_LONG_SIDE / max(width, height))
            w, h = _align(width * factor), _align(height * factor)
        return (self.width or w, self.height or h)

    def shape(self, width: int, height: int) -> tuple[int, ...]:
        image = (height, width, 3) if self.layout == "HWC" else (3, height, width)
        return (1, *image) if self.batch else image

    def byte_size(self, width: int, height: int) -> int:
        return 3 * width * height * datatypes.element_size(self.datatype)


def _align(value: float) -> int:
    return max(ALIGN, int(np.ceil(value / ALIGN)) * ALIGN)


def _reformat(frame: Any, width: int, height: int, fmt: str | None) -> Any:
    """swscale, with its context kept per thread and geometry (a new one per frame, as
    VideoFrame.reformat makes, costs another 1 ms) and on this thread only: the CPU is counted where
    it is spent, and with one stream per core, slice threads would only add hand-offs."""
    key = (frame.width, frame.height, frame.format.name, width, height, fmt)
    cache: dict[tuple[Any, ...], Any] = _local.__dict__.setdefault("reformatters", {})
    reformatter = cache.get(key)
    if reformatter is None:
        from av.video.reformatter import VideoReformatter

        if len(cache) >= 32:
            cache.clear()
        reformatter = cache[key] = VideoReformatter()
    if _THREADS_ARGUMENT:
        return reformatter.reformat(frame, width, height, fmt, interpolation=INTERPOLATION, threads=1)
    return reformatter.reformat(frame, width, height, fmt, interpolation=INTERPOLATION)


def _threads_argument() -> bool:
    """PyAV 17 added `threads` to reformat (and made it multithreaded by default)."""
    try:
        import av
    except ImportError:
        return False
    return int(str(av.__version__).split(".")[0]) >= 17


_THREADS_ARGUMENT = _threads_argument()


def _resized(frame: Any, width: int, height: int) -> Any:
    """The frame at `width` x `height`, still in its own format when that is YUV (the cheap order:
    see the module's docstring)."""
    if (frame.width, frame.height) == (width, height) or not frame.format.name.startswith(("yuv", "nv")):
        return frame
    return _reformat(frame, width, height, None)


def rgb_of(frame: Any, width: int, height: int, bgr: bool = False) -> npt.NDArray[np.uint8]:
    """Packed RGB (or BGR) at `width` x `height` (a view of swscale's output): a PyAV VideoFrame is
    resized, then converted; an ndarray (RGB, from GStreamer) is resized by nearest pixel."""
    if isinstance(frame, np.ndarray):
        rgb = _nearest(frame, width, height)
        return rgb[..., ::-1] if bgr else rgb
    out = _reformat(_resized(frame, width, height), width, height, "bgr24" if bgr else "rgb24")
    array: npt.NDArray[np.uint8] = out.to_ndarray()
    return array


def planes_of(frame: Any, width: int, height: int, bgr: bool = False) -> list[npt.NDArray[np.uint8]]:
    """The R, G, B (or B, G, R) planes at `width` x `height`, each [height, width] (views of
    swscale's planar output, rows possibly padded)."""
    if isinstance(frame, np.ndarray):
        rgb = _nearest(frame, width, height)
        return [rgb[..., c] for c in ((2, 1, 0) if bgr else (0, 1, 2))]
    out = _reformat(_resized(frame, width, height), width, height, "gbrp")
    planes = out.planes
    views = []
    for index in (1, 0, 2) if bgr else (2, 0, 1):  # gbrp stores G, B, R
        plane = planes[index]
        rows = np.frombuffer(plane, np.uint8, count=plane.line_size * height).reshape(height, plane.line_size)
        views.append(rows[:, :width])
    return views


def _nearest(rgb: npt.NDArray[np.uint8], width: int, height: int) -> npt.NDArray[np.uint8]:
    if rgb.shape[:2] == (height, width):
        return rgb
    ys = (np.arange(height) * rgb.shape[0] // height).astype(np.intp)
    xs = (np.arange(width) * rgb.shape[1] // width).astype(np.intp)
    picked: npt.NDArray[np.uint8] = rgb[ys[:, None], xs[None, :]]
    return picked


def _fill(target: npt.NDArray[Any], source: npt.NDArray[Any], scale: float) -> None:
    if scale == 1.0 or target.dtype == np.uint8:
        np.copyto(target, source, casting="unsafe")
    else:
        np.multiply(source, np.float32(scale), out=target, casting="unsafe")


def _write(frame: Any, target: npt.NDArray[Any], spec: InputSpec, width: int, height: int) -> None:
    """The model's input into `target` ([H, W, 3] or [3, H, W] of the model's dtype)."""
    if spec.layout == "HWC":
        _fill(target, rgb_of(frame, width, height, spec.bgr), spec.scale)
        return
    for channel, plane in zip(target, planes_of(frame, width, height, spec.bgr), strict=True):
        _fill(channel, plane, spec.scale)


def write_input(frame: Any, slot: Slot, spec: InputSpec, width: int, height: int) -> ShmTensor:
    """Convert `frame` to the model's input at `width` x `height` straight into `slot`."""
    shape = spec.shape(width, height)
    dtype = datatypes.numpy_dtype(spec.datatype)
    view = slot.ndarray(shape, dtype)
    _write(frame, view.reshape(shape[1:] if spec.batch else shape), spec, width, height)
    del view
    return slot.tensor(shape, dtype)


def to_array(frame: Any, spec: InputSpec, width: int, height: int) -> npt.NDArray[Any]:
    """The model's input as a new array (for transports without ring slots, e.g. gRPC)."""
    shape = spec.shape(width, height)
    out = np.empty(shape, datatypes.numpy_dtype(spec.datatype))
    _write(frame, out.reshape(shape[1:] if spec.batch else shape), spec, width, height)
    return out
