"""OCR pipeline step 1: a camera frame -> PP-OCR detection input (a Triton Python model; numpy only).

The frame (HWC uint8, RGB unless the config's `channel_order` says BGR) is resized so that its
longer side is at most `limit_side_len` (PaddleOCR's det_limit_type "max"; "min" makes the shorter
side at least that, as rapidocr does), both sides rounded to multiples of 32, with bilinear
interpolation, then normalised as PP-OCR expects: BGR, (v / 255 - 0.5) / 0.5, NCHW.

Inputs:  IMAGE UINT8 [H, W, 3]
Outputs: DET_INPUT FP32 [1, 3, h, w], SHAPE FP32 [4] = (H, W, h, w)
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

LIMIT_SIDE_LEN = 960
LIMIT_TYPE = "max"


def target_size(h: int, w: int, limit: int = LIMIT_SIDE_LEN, kind: str = LIMIT_TYPE) -> tuple[int, int]:
    if kind == "max":
        ratio = limit / max(h, w) if max(h, w) > limit else 1.0
    else:
        ratio = limit / min(h, w) if min(h, w) < limit else 1.0
    return max(32, round(int(h * ratio) / 32) * 32), max(32, round(int(w * ratio) / 32) * 32)


def resize_bilinear(image: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """HWC float32 resize with half-pixel centres (as OpenCV's INTER_LINEAR when enlarging)."""
    h, w = image.shape[:2]
    img = image.astype(np.float32)
    if (h, w) == (out_h, out_w):
        return img
    ys = np.clip((np.arange(out_h) + 0.5) * h / out_h - 0.5, 0, h - 1)
    xs = np.clip((np.arange(out_w) + 0.5) * w / out_w - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(np.intp), np.floor(xs).astype(np.intp)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    fy, fx = (ys - y0)[:, None, None].astype(np.float32), (xs - x0)[None, :, None].astype(np.float32)
    rows0, rows1 = img[y0], img[y1]
    top = rows0[:, x0] * (1 - fx) + rows0[:, x1] * fx
    bottom = rows1[:, x0] * (1 - fx) + rows1[:, x1] * fx
    return top * (1 - fy) + bottom * fy


def preprocess(image: np.ndarray, bgr: bool = False, limit: int = LIMIT_SIDE_LEN,
               kind: str = LIMIT_TYPE) -> dict[str, np.ndarray]:  # fmt: skip
    if image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 1:
        raise ValueError(f"IMAGE must be H x W x 3 uint8, got shape {list(image.shape)}")
    h, w = image.shape[:2]
    out_h, out_w = target_size(h, w, limit, kind)
    frame = image if bgr else image[..., ::-1]
    resized = resize_bilinear(frame, out_h, out_w)
    det = (resized * np.float32(1 / 127.5) - np.float32(1.0)).transpose(2, 0, 1)[None]
    return {
        "DET_INPUT": np.ascontiguousarray(det, dtype=np.float32),
        "SHAPE": np.array([h, w, out_h, out_w], np.float32),
    }


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        parameters = json.loads(args["model_config"]).get("parameters", {})

        def param(key: str, default: str) -> str:
            return str(parameters.get(key, {}).get("string_value", default))

        self.bgr = param("channel_order", "RGB").upper() == "BGR"
        self.limit = int(param("limit_side_len", str(LIMIT_SIDE_LEN)))
        self.kind = param("limit_type", LIMIT_TYPE)

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            try:
                outputs = preprocess(image, self.bgr, self.limit, self.kind)
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
        return responses
