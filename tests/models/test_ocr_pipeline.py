"""The OCR pipeline in models/ (issue 15): text rendered with Pillow goes through the running server as
one model, `ocr` (an ensemble of Python and ONNX steps), over HTTP, gRPC, ZeroMQ and ZeroMQ + a
shared-memory frame ring, and comes back as the rendered string with its box. Plus the numpy pieces
of the box-extraction step against known geometry.

Needs the sample models (`edgeserve samples`, which scripts/test.sh runs); the font is Pillow's own
scalable default (Pillow >= 10.1), so nothing comes from the system.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from python_models import sample_step

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
NEEDED = [MODELS / m / "1" / "model.onnx" for m in ("ppocr_det", "ppocr_cls", "ppocr_rec")]
NEEDED.append(MODELS / "ocr_decode" / "1" / "ppocr_keys.txt")
TEXT = "EDGESERVE 2026"


def render(text: str = TEXT, size: tuple[int, int] = (640, 160), font_size: int = 64,
           upside_down: bool = False) -> np.ndarray:  # fmt: skip
    """Black text on white, HWC uint8 RGB, in Pillow's built-in scalable font."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((30, 40), text, fill="black", font=ImageFont.load_default(size=font_size))
    if upside_down:
        image = image.rotate(180)
    return np.asarray(image)


# -- the numpy geometry of ocr_boxes ------------------------------------------------------------------
def test_components_and_rectangles() -> None:
    boxes = sample_step("ocr_boxes")
    mask = np.zeros((40, 60), bool)
    mask[5:15, 10:50] = True  # a bar
    mask[25:30, 5:8] = True  # a small blob
    mask[30, 8] = True  # touches the blob diagonally: same component (8-connectivity)
    found = boxes.components(mask)
    assert len(found) == 2
    corners, w, h = boxes.min_area_rect(found[0])
    assert sorted((round(w), round(h))) == [9, 39]  # pixel centres 10..49 x 5..14
    ordered = boxes.order_clockwise(corners)
    assert ordered[0].tolist() == [10, 5] and ordered[2].tolist() == [49, 14]
    # a rotated rectangle is found at its angle, not as its axis-aligned bounding box
    ys, xs = np.mgrid[0:100, 0:100]
    u, v = (
        (xs - 50) * np.cos(0.4) + (ys - 50) * np.sin(0.4),
        -(xs - 50) * np.sin(0.4) + (ys - 50) * np.cos(0.4),
    )
    rotated = (np.abs(u) <= 30) & (np.abs(v) <= 8)
    _, w, h = boxes.min_area_rect(boxes.components(rotated)[0])
    assert abs(max(w, h) - 60) < 2 and abs(min(w, h) - 16) < 2


def test_boxes_decode_and_rotate_in_process() -> None:
    """The Python steps' own functions, with a synthetic probability map and recognizer output."""
    boxes, rotate, decode = sample_step("ocr_boxes"), sample_step("ocr_rotate"), sample_step("ocr_decode")
    prob = np.zeros((1, 1, 64, 128), np.float32)
    prob[0, 0, 20:40, 10:110] = 0.9
    image = np.full((128, 256, 3), 255, np.uint8)
    out = boxes.extract(prob, image, np.array([128, 256, 64, 128], np.float32))
    assert out["BOXES"].shape == (1, 4, 2) and out["CLS_CROPS"].shape == (1, 3, 48, 192)
    x0, y0 = out["BOXES"][0][0]
    x1, y1 = out["BOXES"][0][2]
    # pixel centres 10..110 x 20..40 (dilated) grown by 100 * 20 * 1.6 / 240 = 13.3 per side, on integer
    # points, then scaled x2 and clipped: what rapidocr's DBPostProcess (OpenCV + pyclipper) gives
    assert [round(v) for v in (x0, y0, x1, y1)] == [0, 14, 246, 106], (x0, y0, x1, y1)
    assert out["REC_CROPS"].shape[3] >= 320 and 0 < out["REC_WIDTHS"][0] <= out["REC_CROPS"].shape[3]
    empty = boxes.extract(
        np.zeros((1, 1, 32, 32), np.float32), image, np.array([128, 256, 32, 32], np.float32)
    )
    assert empty["BOXES"].shape == (0, 4, 2) and empty["REC_CROPS"].shape == (0, 3, 48, 320)

    crops = np.arange(2 * 3 * 48 * 8, dtype=np.float32).reshape(2, 3, 48, 8)
    turned = rotate.rotate(
        crops, np.array([8, 5], np.int32), np.array([[0.99, 0.01], [0.02, 0.98]], np.float32)
    )
    np.testing.assert_array_equal(turned[0], crops[0])
    np.testing.assert_array_equal(turned[1, :, :, :5], crops[1, :, ::-1, 4::-1])
    np.testing.assert_array_equal(turned[1, :, :, 5:], crops[1, :, :, 5:])

    characters = ["blank", "A", "B", " "]
    probs = np.full((3, 6, 4), 0.01, np.float32)
    for row, steps in enumerate([[1, 1, 0, 2, 3, 1], [0, 0, 0, 0, 0, 0], [2, 0, 2, 0, 0, 0]]):
        probs[row, np.arange(6), steps] = 0.97
    probs[2, :, :] = 0.25  # unsure: under text_score
    result = decode.finish(probs, np.zeros((3, 4, 2), np.float32), characters)
    assert result["TEXT"].tolist() == [b"AB A"] and result["BOXES_OUT"].shape == (1, 4, 2)


@pytest.mark.parametrize("angle", [0, 20, 90, 180])
def test_turned_lines_in_process(angle: int) -> None:
    """The pipeline's steps chained by hand on onnxruntime: a line turned 20 degrees (a rotated box),
    90 (vertical: the crop is turned a quarter) and 180 (the classifier flags it) reads the same."""
    missing = [str(p.relative_to(ROOT)) for p in NEEDED if not p.exists()]
    if missing:
        pytest.skip(f"sample models missing ({', '.join(missing)}): run `edgeserve samples`")
    from PIL import Image, ImageDraw, ImageFont

    ort = pytest.importorskip("onnxruntime")
    pre, boxes, rotate, decode = (
        sample_step(n) for n in ("ocr_pre", "ocr_boxes", "ocr_rotate", "ocr_decode")
    )
    det, cls, rec = (ort.InferenceSession(str(MODELS / m / "1" / "model.onnx"))
                     for m in ("ppocr_det", "ppocr_cls", "ppocr_rec"))  # fmt: skip
    image = Image.new("RGB", (640, 480), "white")
    ImageDraw.Draw(image).text((120, 200), "ROTATED 42", fill="black", font=ImageFont.load_default(size=48))
    frame = np.asarray(image.rotate(angle, fillcolor="white"))
    x = pre.preprocess(frame)
    found = boxes.extract(det.run(None, {"x": x["DET_INPUT"]})[0], frame, x["SHAPE"])
    probs = cls.run(None, {"x": found["CLS_CROPS"]})[0]
    upright = rotate.rotate(found["REC_CROPS"], found["REC_WIDTHS"], probs)
    characters = decode.load_characters(MODELS / "ocr_decode" / "1" / "ppocr_keys.txt")
    out = decode.finish(rec.run(None, {"x": upright})[0], found["BOXES"], characters)
    assert _texts(out["TEXT"]) == ["ROTATED 42"]
    assert out["SCORES"][0] > 0.9


# -- end to end through a running server --------------------------------------------------------------
@pytest.fixture(scope="module")
def ocr_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    missing = [str(p.relative_to(ROOT)) for p in NEEDED if not p.exists()]
    if missing:
        pytest.skip(f"sample models missing ({', '.join(missing)}): run `edgeserve samples`")
    pytest.importorskip("PIL")
    sys.path.insert(0, str(ROOT / "tests"))
    from es_server import start_server

    server = start_server(MODELS, tmp_path_factory.mktemp("ocr"), args=["--load-model", "ocr"], timeout=240)
    yield server
    server.stop()


def _texts(values: Any) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in np.asarray(values).reshape(-1)]


def _check(result: dict[str, np.ndarray]) -> str:
    texts = _texts(result["TEXT"])
    assert len(texts) == 1, texts
    assert texts[0].replace(" ", "") == TEXT.replace(" ", ""), texts  # PP-OCR may drop the space
    assert result["BOXES"].shape == (1, 4, 2) and result["SCORES"].shape == (1,)
    assert result["SCORES"][0] > 0.8
    (left, top), (right, bottom) = result["BOXES"][0][0], result["BOXES"][0][2]
    assert 10 <= left <= 60 and 30 <= top <= 80 and 450 <= right <= 620 and 80 <= bottom <= 140
    return texts[0]


def test_ocr_over_http_grpc_zeromq_and_shm(ocr_server: Any) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from edgeserve.client import ClientError, ZmqClient

    frame = render()
    seen: dict[str, str] = {}

    http = httpclient.InferenceServerClient(ocr_server.http_url)
    image = httpclient.InferInput("IMAGE", list(frame.shape), "UINT8")
    image.set_data_from_numpy(frame)
    response = http.infer("ocr", [image])
    seen["http"] = _check({n: response.as_numpy(n) for n in ("TEXT", "BOXES", "SCORES")})
    only = http.infer("ocr", [image], outputs=[httpclient.InferRequestedOutput("TEXT")])
    assert [o["name"] for o in only.get_response()["outputs"]] == ["TEXT"]

    grpc = grpcclient.InferenceServerClient(ocr_server.grpc_url)
    image = grpcclient.InferInput("IMAGE", list(frame.shape), "UINT8")
    image.set_data_from_numpy(frame)
    response = grpc.infer("ocr", [image])
    seen["grpc"] = _check({n: response.as_numpy(n) for n in ("TEXT", "BOXES", "SCORES")})
    assert grpc.get_model_metadata("ocr").platform == "ensemble"

    with ZmqClient(ocr_server.zmq_endpoint, timeout=60) as client:
        result = client.infer("ocr", {"IMAGE": frame})
        seen["zmq"] = _check({n: result.as_numpy(n) for n in ("TEXT", "BOXES", "SCORES")})
        ring = client.create_ring(2, frame.nbytes)
        slot = client.acquire_slot(ring)
        result = client.infer("ocr", {"IMAGE": slot.write(frame)})
        seen["zmq+shm"] = _check({n: result.as_numpy(n) for n in ("TEXT", "BOXES", "SCORES")})
        # upside down: the direction classifier flags it and the crop is turned before recognition
        flipped = client.infer("ocr", {"IMAGE": render(upside_down=True)})
        assert _texts(flipped.as_numpy("TEXT"))[0].replace(" ", "") == TEXT.replace(" ", "")
        # nothing to read: empty outputs through every step (zero crops skip the cls/rec models)
        blank = client.infer("ocr", {"IMAGE": np.full((120, 200, 3), 255, np.uint8)})
        assert blank.as_numpy("TEXT").shape == (0,) and blank.as_numpy("BOXES").shape == (0, 4, 2)
        # a step failing mid-request (here the first, on an empty frame) fails it with the step named
        with pytest.raises(ClientError) as failed:
            client.infer("ocr", {"IMAGE": np.zeros((0, 8, 3), np.uint8)})
        assert failed.value.status == "INVALID_ARG"
        assert "ensemble 'ocr' step 0 'ocr_pre': " in str(failed.value) and "H x W x 3" in str(failed.value)
    assert len(set(seen.values())) == 1, seen  # the same string whatever the frontend

    # a step model records its statistics just after answering: wait for the last ones (generously)
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(f"{ocr_server.base}/v2/models/stats", timeout=10) as reply:
            stats = {s["name"]: s for s in json.loads(reply.read())["model_stats"]}
        if stats["ocr_decode"]["inference_stats"]["success"]["count"] >= 7 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats["ocr"]["inference_stats"]["success"]["count"] == 7
    assert stats["ocr"]["inference_stats"]["fail"]["count"] == 1
    assert [s["model"] for s in stats["ocr"]["ensemble_steps"]] == [
        "ocr_pre", "ppocr_det", "ocr_boxes", "ppocr_cls", "ocr_rotate", "ppocr_rec", "ocr_decode"
    ]  # fmt: skip
    for step in ("ocr_pre", "ppocr_det", "ocr_boxes", "ocr_rotate", "ocr_decode"):
        assert stats[step]["inference_stats"]["success"]["count"] == 7, step
    assert stats["ppocr_rec"]["inference_stats"]["success"]["count"] == 6  # the blank frame has no crop
