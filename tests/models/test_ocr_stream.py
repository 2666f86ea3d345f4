"""The sample decoupled model models/ocr_stream (issue 35): OCR on a frame streamed one text line per
response over a gRPC stream (tritonclient), each line as soon as it is read; the same lines, boxes
and scores as the `ocr` ensemble on the same frame; two frames in flight on one stream (async execute);
a frame with no text is the final flag alone; a failing step ends the stream with its error.

Needs the sample models (`edgeserve samples`, which scripts/test.sh runs) and Pillow (its built-in font).
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
NEEDED = [MODELS / m / "1" / "model.onnx" for m in ("ppocr_det", "ppocr_cls", "ppocr_rec")]
NEEDED.append(MODELS / "ocr_decode" / "1" / "ppocr_keys.txt")
LINES = ("EDGESERVE 2026", "STREAMED LINES", "ONE BY ONE")
WAIT_S = 120.0  # generous: a shared 2-core box; nothing here measures speed

pytestmark = pytest.mark.timeout(600)


def frame(lines: tuple[str, ...] = LINES) -> np.ndarray:
    """Black lines of text on white, HWC uint8 RGB, in Pillow's built-in scalable font."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (720, 120 * len(lines) + 40), "white")
    draw = ImageDraw.Draw(image)
    for row, text in enumerate(lines):
        draw.text((30, 30 + 120 * row), text, fill="black", font=ImageFont.load_default(size=56))
    return np.asarray(image)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    missing = [str(p.relative_to(ROOT)) for p in NEEDED if not p.exists()]
    if missing:
        pytest.skip(f"sample models missing ({', '.join(missing)}): run `edgeserve samples`")
    pytest.importorskip("PIL")
    sys.path.insert(0, str(ROOT / "tests"))
    from es_server import start_server

    args = ["--load-model", "ocr", "--load-model", "ocr_stream"]  # ocr loads the steps ocr_stream calls
    running = start_server(MODELS, tmp_path_factory.mktemp("ocr_stream"), args=args, timeout=240)
    yield running
    running.stop()


def _stream(server: Any, frames: dict[str, np.ndarray]) -> dict[str, list[Any]]:
    """Each frame as a request (its id the key) on one stream; every response of each, in the order
    they came, the empty final one last."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    got: dict[str, list[Any]] = {key: [] for key in frames}
    try:
        for key, image in frames.items():
            tensor = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
            tensor.set_data_from_numpy(image)
            client.async_stream_infer(
                "ocr_stream", [tensor], request_id=key, enable_empty_final_response=True
            )
        open_requests = set(frames)
        while open_requests:
            result, error = answers.get(timeout=WAIT_S)
            if error is not None:  # an error response is its request's last (one request open here)
                assert len(open_requests) == 1, error
                failed = open_requests.pop()
                got[failed].append(error)
                continue
            response = result.get_response()
            got[response.id].append(result)
            if response.parameters["triton_final_response"].bool_param:
                open_requests.discard(response.id)
    finally:
        client.stop_stream()
    return got


def _ensemble(server: Any, image: np.ndarray) -> dict[str, np.ndarray]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, network_timeout=WAIT_S)
    tensor = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
    tensor.set_data_from_numpy(image)
    result = client.infer("ocr", [tensor])
    return {name: result.as_numpy(name) for name in ("TEXT", "BOXES", "SCORES")}


def test_each_line_is_its_own_response_with_the_ensembles_answer(server: Any) -> None:
    image = frame()
    responses = _stream(server, {"frame": image})["frame"]
    lines, final = responses[:-1], responses[-1]
    assert not final.get_response().outputs  # the final flag alone, after the lines
    assert len(lines) == len(LINES)
    texts = [r.as_numpy("TEXT")[0].decode() for r in lines]
    # PP-OCR may drop a space
    assert [t.replace(" ", "") for t in texts] == [t.replace(" ", "") for t in LINES]
    for result in lines:
        assert result.as_numpy("TEXT").shape == (1,) and result.as_numpy("BOXES").shape == (1, 4, 2)
        assert not result.get_response().parameters["triton_final_response"].bool_param
    whole = _ensemble(server, image)
    assert [t.decode() for t in whole["TEXT"]] == texts
    np.testing.assert_allclose(np.concatenate([r.as_numpy("BOXES") for r in lines]), whole["BOXES"])
    scores = np.concatenate([r.as_numpy("SCORES") for r in lines])
    np.testing.assert_allclose(scores, whole["SCORES"], rtol=1e-5)


def test_two_frames_in_flight_on_one_stream_and_a_blank_frame(server: Any) -> None:
    blank = np.full((120, 200, 3), 255, np.uint8)
    frames = {"two": frame(LINES[:2]), "one": frame(LINES[2:]), "blank": blank}
    got = _stream(server, frames)
    read = {key: [r.as_numpy("TEXT")[0].decode().replace(" ", "") for r in responses[:-1]]
            for key, responses in got.items()}  # fmt: skip
    assert read == {"two": ["EDGESERVE2026", "STREAMEDLINES"], "one": ["ONEBYONE"], "blank": []}


def test_a_failing_step_ends_the_stream_with_its_error(server: Any) -> None:
    from tritonclient.utils import InferenceServerException

    responses = _stream(server, {"empty": np.zeros((0, 8, 3), np.uint8)})["empty"]
    assert len(responses) == 1 and isinstance(responses[0], InferenceServerException)
    assert "ocr_stream step 'ocr_pre'" in str(responses[0])
