"""Decoded frame -> the model's input, written into a ring slot.

The layout comes from the model's metadata (its first input): HWC or CHW, with or without a batch
axis, UINT8 or a float type, fixed or dynamic height and width. Colour conversion and resizing are
one swscale pass (PyAV's reformat) straight to packed RGB (or BGR); then either one copy into the
slot (UINT8 HWC) or one pass that transposes, scales and casts into the slot (float CHW): the slot
is written once, and nothing else is allocated per frame beyond swscale's output.
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
        (--size), then the frame's own size (UINT8 inputs: the model resizes itself, e.g. the OCR
        pipeline) or, for float inputs, the frame fitted into DEFAULT_LONG_SIDE, rounded up to ALIGN."""
        w, h = wanted if wanted is not None else (width, height)
        if wanted is None and self.datatype != "UINT8":
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


def rgb_of(frame: Any, width: int, height: int, bgr: bool = False) -> npt.NDArray[np.uint8]:
    """Packed RGB (or BGR) at `width` x `height`: a PyAV VideoFrame goes through swscale once (colour
    conversion and resize together); an ndarray (RGB, from GStreamer) is resized by nearest pixel."""
    if isinstance(frame, np.ndarray):
        rgb = frame
        if rgb.shape[:2] != (height, width):
            ys = (np.arange(height) * rgb.shape[0] // height).astype(np.intp)
            xs = (np.arange(width) * rgb.shape[1] // width).astype(np.intp)
            rgb = rgb[ys[:, None], xs[None, :]]
        return rgb[..., ::-1] if bgr else rgb
    key = (frame.width, frame.height, frame.format.name, width, height, bgr)
    cache: dict[tuple[Any, ...], Any] = _local.__dict__.setdefault("reformatters", {})
    reformatter = cache.get(key)
    if reformatter is None:
        from av.video.reformatter import VideoReformatter

        if len(cache) >= 16:
            cache.clear()
        reformatter = cache[key] = VideoReformatter()
    out = reformatter.reformat(frame, width, height, "bgr24" if bgr else "rgb24", interpolation=INTERPOLATION)
    array: npt.NDArray[np.uint8] = np.asarray(out.to_ndarray(), np.uint8)
    return array


def write_input(frame: Any, slot: Slot, spec: InputSpec, width: int, height: int) -> ShmTensor:
    """Convert `frame` to the model's input at `width` x `height` straight into `slot`."""
    rgb = rgb_of(frame, width, height, spec.bgr)
    shape = spec.shape(width, height)
    if spec.datatype == "UINT8" and spec.layout == "HWC":
        return slot.write(rgb.reshape(shape))
    dtype = datatypes.numpy_dtype(spec.datatype)
    view = slot.ndarray(shape, dtype)
    target = view.reshape((height, width, 3) if spec.layout == "HWC" else (3, height, width))
    source = rgb if spec.layout == "HWC" else rgb.transpose(2, 0, 1)
    if spec.scale == 1.0:
        np.copyto(target, source, casting="unsafe")
    else:
        np.multiply(source, np.float32(spec.scale), out=target, casting="unsafe")
    del view, target
    return slot.tensor(shape, dtype)


def to_array(frame: Any, spec: InputSpec, width: int, height: int) -> npt.NDArray[Any]:
    """The model's input as a new array (for transports without ring slots, e.g. gRPC)."""
    rgb = rgb_of(frame, width, height, spec.bgr)
    image = rgb if spec.layout == "HWC" else rgb.transpose(2, 0, 1)
    out = np.empty(image.shape, datatypes.numpy_dtype(spec.datatype))
    if spec.scale == 1.0 or spec.datatype == "UINT8":
        np.copyto(out, image, casting="unsafe")
    else:
        np.multiply(image, np.float32(spec.scale), out=out, casting="unsafe")
    return out.reshape(spec.shape(width, height))
