"""OCR pipeline step 5: turn the recognizer's crops the direction classifier found upside down
(a Triton Python model; numpy only).

ppocr_cls gives [p(0 deg), p(180 deg)] per crop; a crop with p(180) above `cls_thresh` (0.9, as
rapidocr) is rotated 180 degrees within its valid width (the zero padding stays on the right).

Inputs:  REC_CROPS FP32 [n, 3, 48, W], REC_WIDTHS INT32 [n], CLS_PROBS FP32 [n, 2]
Outputs: REC_INPUT FP32 [n, 3, 48, W]
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

CLS_THRESH = 0.9


def rotate(crops: np.ndarray, widths: np.ndarray, probs: np.ndarray, thresh: float = CLS_THRESH) -> Any:
    flagged = np.nonzero((probs.argmax(axis=1) == 1) & (probs.max(axis=1) > thresh))[0]
    if not len(flagged):
        return crops
    out = crops.copy()
    for i in flagged:
        w = int(widths[i])
        out[i, :, :, :w] = crops[i, :, ::-1, w - 1 :: -1] if w > 0 else crops[i, :, :, :0]
    return out


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.thresh = float(parameters.get("cls_thresh", {}).get("string_value", CLS_THRESH))

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            crops, widths, probs = (pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                                    for name in ("REC_CROPS", "REC_WIDTHS", "CLS_PROBS"))  # fmt: skip
            rotated = rotate(crops, widths, probs, self.thresh)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("REC_INPUT", rotated)]))
        return responses
