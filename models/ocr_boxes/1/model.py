"""OCR pipeline step 3: text boxes out of PP-OCR's detection map, and the crops for the classifier
and the recognizer (a Triton Python model; numpy only, no OpenCV).

PP-OCR's DB post-processing as rapidocr-onnxruntime 1.4.4 does it (threshold 0.3, 2x2 dilation,
contours -> minimum-area rectangles, mean probability inside >= 0.5, unclip ratio 1.6, boxes scaled
back to the frame, sorted top-to-bottom then left-to-right), with OpenCV's pieces written in numpy:
8-connected components by runs, convex hull + rotating calipers for the rectangles, a point-in-quad
mask for the box score. Each box is sampled straight from the frame to 48 px high (bilinear, edge
pixels repeated) for the classifier (3x48x192) and the recognizer (3x48xW, one W for the frame:
the widest box's, at least 320), normalised as PP-OCR expects (BGR, (v / 255 - 0.5) / 0.5, zero
padding on the right).

Inputs:  PROB FP32 [1, 1, h, w] (ppocr_det), IMAGE UINT8 [H, W, 3], SHAPE FP32 [4] (ocr_pre)
Outputs: BOXES FP32 [n, 4, 2] (x, y in the frame: top-left, top-right, bottom-right, bottom-left),
         BOX_SCORES FP32 [n], CLS_CROPS FP32 [n, 3, 48, 192], REC_CROPS FP32 [n, 3, 48, W],
         REC_WIDTHS INT32 [n] (columns of each REC_CROPS row holding the crop; the rest is padding)
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

THRESH = 0.3
BOX_THRESH = 0.5
UNCLIP_RATIO = 1.6
MAX_CANDIDATES = 1000
MIN_SIZE = 3
CROP_H = 48
CLS_W = 192
REC_MIN_W = 320


# -- components and rectangles ------------------------------------------------------------------------
def components(mask: np.ndarray) -> list[np.ndarray]:
    """8-connected components of a boolean mask, each as the (x, y) ends of its row runs (enough
    for its convex hull), largest first, at most MAX_CANDIDATES."""
    height, width = mask.shape
    padded = np.zeros((height, width + 2), np.int8)
    padded[:, 1:-1] = mask
    edges = np.diff(padded, axis=1)
    rows, starts = np.nonzero(edges == 1)
    _, stops = np.nonzero(edges == -1)  # exclusive; same row-major order as the starts
    count = len(rows)
    parent = list(range(count))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    row_begin = np.searchsorted(rows, np.arange(height + 1))
    for r in range(1, height):
        a, a_end = int(row_begin[r - 1]), int(row_begin[r])
        b, b_end = a_end, int(row_begin[r + 1])
        while a < a_end and b < b_end:  # runs of the row above and this row, both sorted by x
            if starts[a] <= stops[b] and starts[b] <= stops[a]:  # touch, diagonals included
                root_a, root_b = find(a), find(b)
                if root_a != root_b:
                    parent[root_b] = root_a
            if stops[a] < stops[b]:
                a += 1
            else:
                b += 1
    groups: dict[int, list[int]] = {}
    for i in range(count):
        groups.setdefault(find(i), []).append(i)
    found = []
    for members in groups.values():
        index = np.asarray(members)
        y = rows[index].astype(np.float64)
        left, right = starts[index].astype(np.float64), stops[index].astype(np.float64) - 1
        found.append(np.concatenate([np.stack([left, y], 1), np.stack([right, y], 1)]))
    found.sort(key=len, reverse=True)
    return found[:MAX_CANDIDATES]


def convex_hull(points: np.ndarray) -> np.ndarray:
    """Andrew's monotone chain; counter-clockwise, no repeated end point."""
    pts = np.unique(points, axis=0)
    if len(pts) < 3:
        return pts

    def half(seq: np.ndarray) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for p in seq:
            while len(out) >= 2:
                o, a = out[-2], out[-1]
                if (a[0] - o[0]) * (p[1] - o[1]) - (a[1] - o[1]) * (p[0] - o[0]) > 0:
                    break
                out.pop()
            out.append(p)
        return out

    lower, upper = half(pts), half(pts[::-1])
    return np.array(lower[:-1] + upper[:-1])


def min_area_rect(points: np.ndarray) -> tuple[np.ndarray, float, float]:
    """(4 corners, width, height) of the smallest rectangle around `points` (rotating calipers)."""
    hull = convex_hull(points)
    if len(hull) < 2:
        return np.repeat(hull[:1], 4, axis=0), 0.0, 0.0
    edges = np.roll(hull, -1, axis=0) - hull
    angles = np.unique(np.mod(np.arctan2(edges[:, 1], edges[:, 0]), np.pi / 2))
    cos, sin = np.cos(angles), np.sin(angles)
    # hull in each candidate frame: u along the edge direction, v across it
    u = hull[:, 0][None, :] * cos[:, None] + hull[:, 1][None, :] * sin[:, None]
    v = -hull[:, 0][None, :] * sin[:, None] + hull[:, 1][None, :] * cos[:, None]
    spans_u, spans_v = u.max(1) - u.min(1), v.max(1) - v.min(1)
    best = int(np.argmin(spans_u * spans_v))
    c, s = cos[best], sin[best]
    u0, u1, v0, v1 = u[best].min(), u[best].max(), v[best].min(), v[best].max()
    corners_uv = np.array([[u0, v0], [u1, v0], [u1, v1], [u0, v1]])
    corners = np.stack([corners_uv[:, 0] * c - corners_uv[:, 1] * s,
                        corners_uv[:, 0] * s + corners_uv[:, 1] * c], 1)  # fmt: skip
    return corners, float(spans_u[best]), float(spans_v[best])


def mini_box(corners: np.ndarray) -> np.ndarray:
    """rapidocr's get_mini_boxes ordering: the two left-most points (upper first) and the two
    right-most (upper first), as top-left, top-right, bottom-right, bottom-left."""
    pts = corners[np.argsort(corners[:, 0], kind="stable")]
    first, fourth = (0, 1) if pts[1][1] > pts[0][1] else (1, 0)
    second, third = (2, 3) if pts[3][1] > pts[2][1] else (3, 2)
    return np.array([pts[first], pts[second], pts[third], pts[fourth]])


def inside_quad(box: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Pixel centres (xs, ys grids) inside a convex quad or on its edge (half a pixel of slack,
    like a filled polygon's outline)."""
    inside = np.ones(xs.shape, bool)
    area = 0.0
    for i in range(4):
        a, b = box[i], box[(i + 1) % 4]
        area += a[0] * b[1] - b[0] * a[1]
    orientation = 1.0 if area >= 0 else -1.0
    for i in range(4):
        a, b = box[i], box[(i + 1) % 4]
        edge = b - a
        length = math.hypot(edge[0], edge[1]) or 1.0
        sign = orientation * (edge[0] * (ys - a[1]) - edge[1] * (xs - a[0])) / length
        inside &= sign >= -0.5
    return inside


def box_score(prob: np.ndarray, box: np.ndarray) -> float:
    """Mean probability inside the box (rapidocr's box_score_fast)."""
    h, w = prob.shape
    xmin = int(np.clip(np.floor(box[:, 0].min()), 0, w - 1))
    xmax = int(np.clip(np.ceil(box[:, 0].max()), 0, w - 1))
    ymin = int(np.clip(np.floor(box[:, 1].min()), 0, h - 1))
    ymax = int(np.clip(np.ceil(box[:, 1].max()), 0, h - 1))
    ys, xs = np.mgrid[ymin : ymax + 1, xmin : xmax + 1]
    mask = inside_quad(np.round(box), xs.astype(np.float64), ys.astype(np.float64))
    return float(prob[ymin : ymax + 1, xmin : xmax + 1][mask].mean()) if mask.any() else 0.0


def unclip(corners: np.ndarray, width: float, height: float) -> tuple[np.ndarray, float]:
    """The rectangle grown by area * ratio / perimeter on every side (pyclipper's round offset
    of a rectangle, then its minimum-area rectangle), on integer points; (corners, shorter side)."""
    distance = width * height * UNCLIP_RATIO / (2 * (width + height))
    center = corners.mean(0)
    u = (corners[1] - corners[0]) / (np.linalg.norm(corners[1] - corners[0]) or 1.0)
    v = (corners[3] - corners[0]) / (np.linalg.norm(corners[3] - corners[0]) or 1.0)
    out = []
    for corner in corners:
        offset = corner - center
        out.append(corner + np.sign(offset @ u) * distance * u + np.sign(offset @ v) * distance * v)
    return np.round(np.array(out)), min(width, height) + 2 * distance  # pyclipper works in integers


def detect_boxes(prob: np.ndarray, src_h: int, src_w: int) -> tuple[np.ndarray, np.ndarray]:
    """(boxes [n, 4, 2] in frame pixels, scores [n]) from one probability map [h, w]."""
    height, width = prob.shape
    seg = prob > THRESH
    mask = seg.copy()  # 2x2 dilation, as rapidocr's use_dilation
    mask[1:, :] |= seg[:-1, :]
    mask[:, 1:] |= seg[:, :-1]
    mask[1:, 1:] |= seg[:-1, :-1]
    boxes, scores = [], []
    for points in components(mask):
        corners, w, h = min_area_rect(points)
        if min(w, h) < MIN_SIZE:
            continue
        box = mini_box(corners)
        score = box_score(prob, box)
        if score < BOX_THRESH:
            continue
        grown, side = unclip(box, w, h)
        if side < MIN_SIZE + 2:
            continue
        grown = mini_box(grown)
        grown[:, 0] = np.clip(np.round(grown[:, 0] / width * src_w), 0, src_w)
        grown[:, 1] = np.clip(np.round(grown[:, 1] / height * src_h), 0, src_h)
        box = order_clockwise(grown)
        box[:, 0] = np.clip(box[:, 0], 0, src_w - 1).astype(np.int64)
        box[:, 1] = np.clip(box[:, 1], 0, src_h - 1).astype(np.int64)
        if np.linalg.norm(box[0] - box[1]) <= 3 or np.linalg.norm(box[0] - box[3]) <= 3:
            continue
        boxes.append(box)
        scores.append(score)
    order = sort_boxes(boxes)
    if not order:
        return np.zeros((0, 4, 2), np.float32), np.zeros((0,), np.float32)
    return np.array([boxes[i] for i in order], np.float32), np.array([scores[i] for i in order], np.float32)


def order_clockwise(pts: np.ndarray) -> np.ndarray:
    by_x = pts[np.argsort(pts[:, 0], kind="stable")]
    left, right = by_x[:2], by_x[2:]
    tl, bl = left[np.argsort(left[:, 1], kind="stable")]
    tr, br = right[np.argsort(right[:, 1], kind="stable")]
    return np.array([tl, tr, br, bl], np.float64)


def sort_boxes(boxes: list[np.ndarray]) -> list[int]:
    """Top to bottom, then left to right within 10 px of the same line (rapidocr's sorted_boxes)."""
    order = sorted(range(len(boxes)), key=lambda i: (boxes[i][0][1], boxes[i][0][0]))
    for i in range(len(order) - 1):
        for j in range(i, -1, -1):
            a, b = boxes[order[j]], boxes[order[j + 1]]
            if abs(b[0][1] - a[0][1]) < 10 and b[0][0] < a[0][0]:
                order[j], order[j + 1] = order[j + 1], order[j]
            else:
                break
    return order


# -- crops --------------------------------------------------------------------------------------------
def crop_geometry(box: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(quad as top-left, top-right, bottom-right, bottom-left of the upright crop, width, height);
    a crop 1.5x taller than wide is turned a quarter (vertical text), as rapidocr does."""
    w = int(max(np.linalg.norm(box[0] - box[1]), np.linalg.norm(box[2] - box[3])))
    h = int(max(np.linalg.norm(box[0] - box[3]), np.linalg.norm(box[1] - box[2])))
    if w > 0 and h / w >= 1.5:
        return box[[1, 2, 3, 0]], h, w
    return box, w, h


def sample_quad(image: np.ndarray, quad: np.ndarray, crop_w: int, crop_h: int, out_w: int) -> np.ndarray:
    """The quad resampled to CROP_H x out_w (bilinear), channels first, as float32 0..255."""
    img_h, img_w = image.shape[:2]
    f32 = np.float32
    u = ((np.arange(out_w, dtype=f32) + 0.5) * crop_w / out_w - 0.5) / max(crop_w, 1)
    v = ((np.arange(CROP_H, dtype=f32) + 0.5) * crop_h / CROP_H - 0.5) / max(crop_h, 1)
    s, t = np.clip(u, 0, 1)[None, :], np.clip(v, 0, 1)[:, None]
    p0, p1, p2, p3 = quad.astype(f32)
    x = (1 - s) * (1 - t) * p0[0] + s * (1 - t) * p1[0] + s * t * p2[0] + (1 - s) * t * p3[0]
    y = (1 - s) * (1 - t) * p0[1] + s * (1 - t) * p1[1] + s * t * p2[1] + (1 - s) * t * p3[1]
    np.clip(x, 0, img_w - 1, out=x)
    np.clip(y, 0, img_h - 1, out=y)
    x0, y0 = x.astype(np.intp), y.astype(np.intp)  # floor: both are >= 0
    fx, fy = (x - x0)[..., None], (y - y0)[..., None]
    x1, y1 = np.minimum(x0 + 1, img_w - 1), np.minimum(y0 + 1, img_h - 1)
    flat = image.reshape(-1, image.shape[2])  # one flat gather per neighbour
    row0, row1 = y0 * img_w, y1 * img_w
    a, b = flat[row0 + x0].astype(f32), flat[row0 + x1].astype(f32)
    c, d = flat[row1 + x0].astype(f32), flat[row1 + x1].astype(f32)
    top = a + (b - a) * fx
    bottom = c + (d - c) * fx
    return np.transpose(top + (bottom - top) * fy, (2, 0, 1))


def crops(image: np.ndarray, boxes: np.ndarray, bgr: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(CLS_CROPS [n,3,48,192], REC_CROPS [n,3,48,W], REC_WIDTHS [n]) for the boxes of one frame."""
    frame = image[..., ::-1] if not bgr else image  # PP-OCR was trained on BGR
    shapes = [crop_geometry(box.astype(np.float64)) for box in boxes]
    ratios = [w / max(h, 1) for _, w, h in shapes]
    rec_w = max([REC_MIN_W, *(int(CROP_H * r) for r in ratios)])
    cls = np.zeros((len(shapes), 3, CROP_H, CLS_W), np.float32)
    rec = np.zeros((len(shapes), 3, CROP_H, rec_w), np.float32)
    widths = np.zeros((len(shapes),), np.int32)
    for i, ((quad, w, h), ratio) in enumerate(zip(shapes, ratios, strict=True)):
        for out, limit in ((cls, CLS_W), (rec, rec_w)):
            target = max(1, min(limit, math.ceil(CROP_H * ratio)))
            out[i, :, :, :target] = sample_quad(frame, quad, w, h, target) / 127.5 - 1.0
            if out is rec:
                widths[i] = target
    return cls, rec, widths


def extract(prob: np.ndarray, image: np.ndarray, shape: np.ndarray, bgr: bool = False) -> dict[str, Any]:
    """The whole step on numpy arrays (what execute() runs per request)."""
    src_h, src_w = int(shape[0]), int(shape[1])
    boxes, scores = detect_boxes(prob.reshape(prob.shape[-2:]).astype(np.float32), src_h, src_w)
    cls, rec, widths = crops(image, boxes, bgr)
    return {"BOXES": boxes, "BOX_SCORES": scores, "CLS_CROPS": cls, "REC_CROPS": rec, "REC_WIDTHS": widths}


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        order = config.get("parameters", {}).get("channel_order", {}).get("string_value", "RGB")
        self.bgr = order.upper() == "BGR"

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            arrays = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                      for name in ("PROB", "IMAGE", "SHAPE")}  # fmt: skip
            outputs = extract(arrays["PROB"], arrays["IMAGE"], arrays["SHAPE"], self.bgr)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
        return responses
