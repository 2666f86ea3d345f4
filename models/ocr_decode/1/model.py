"""OCR pipeline step 7: CTC decoding of the recognizer's output into text (a Triton Python model).

Greedy CTC as PP-OCR: the best class per time step, repeats merged, blanks dropped, the score is
the mean probability of the kept steps; lines scoring under `text_score` (0.5, as rapidocr) or
empty are left out, with their boxes. The dictionary is PP-OCRv4's (6623 characters, index 0 is the
CTC blank, the last is a space): `ppocr_keys.txt` in the version folder, written by
`edgeserve samples` from the rec model's own metadata.

Inputs:  REC_PROBS FP32 [n, T, 6625], BOXES FP32 [n, 4, 2], BOX_SCORES FP32 [n]
Outputs: TEXT BYTES [m], BOXES_OUT FP32 [m, 4, 2], SCORES FP32 [m]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

KEYS_FILE = "ppocr_keys.txt"
TEXT_SCORE = 0.5


def load_characters(path: Path) -> list[str]:
    """["blank", *dictionary, " "]: the rec model's class order."""
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return ["blank", *lines, " "]


def decode(probs: np.ndarray, characters: list[str]) -> list[tuple[str, float]]:
    best = probs.argmax(axis=2)
    best_p = probs.max(axis=2)
    results = []
    for idx, p in zip(best, best_p, strict=True):
        keep = np.ones(len(idx), bool)
        keep[1:] = idx[1:] != idx[:-1]
        keep &= idx != 0
        text = "".join(characters[i] if i < len(characters) else "" for i in idx[keep])
        results.append((text, float(p[keep].mean()) if keep.any() else 0.0))
    return results


def finish(probs: np.ndarray, boxes: np.ndarray, characters: list[str],
           text_score: float = TEXT_SCORE) -> dict[str, np.ndarray]:  # fmt: skip
    lines = decode(probs, characters) if len(probs) else []
    keep = [i for i, (text, score) in enumerate(lines) if text.strip() and score >= text_score]
    return {
        "TEXT": np.array([lines[i][0].encode("utf-8") for i in keep], dtype=np.object_),
        "BOXES_OUT": boxes[keep].astype(np.float32).reshape(len(keep), 4, 2),
        "SCORES": np.array([lines[i][1] for i in keep], np.float32),
    }


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        folder = Path(args["model_repository"]) / str(args["model_version"])
        path = folder / KEYS_FILE
        if not path.is_file():
            hint = "run `edgeserve samples` to extract PP-OCR's dictionary"
            raise FileNotFoundError(f"{path} is missing: {hint}")
        self.characters = load_characters(path)
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.text_score = float(parameters.get("text_score", {}).get("string_value", TEXT_SCORE))

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            probs = pb_utils.get_input_tensor_by_name(request, "REC_PROBS").as_numpy()
            boxes = pb_utils.get_input_tensor_by_name(request, "BOXES").as_numpy()
            outputs = finish(probs, boxes, self.characters, self.text_score)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
        return responses
