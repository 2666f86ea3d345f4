"""The gRPC streaming example app (edgeserve/video/grpc_stream.py): a file decoded and streamed
through ModelStreamInfer with 4 frames in flight; every result comes back, in frame order, right."""

from __future__ import annotations

import pytest

pytest.importorskip("av", reason="the [video] extra (PyAV) is not installed")

import json
import subprocess
import sys

from es_server import ROOT
from video_clips import expected_boxes, face_inside

from edgeserve.video.grpc_stream import stream_video


def test_frames_stream_through_model_stream_infer_in_order(clips, video_server) -> None:
    results = list(stream_video(str(clips["h264"]), "centerface", video_server.grpc_url, inflight=4))
    assert [r.frame for r in results] == list(range(60))
    boxes = expected_boxes(60)
    assert all(face_inside(r, box) for r, box in zip(results, boxes, strict=True))
    assert results[3].pts is not None and abs(results[3].pts - 0.3) < 1e-6


def test_the_example_as_a_program(clips, video_server) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeserve.video.grpc_stream",
            str(clips["text"]),
            "--model",
            "ocr",
            "--url",
            video_server.grpc_url,
            "--inflight",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["frame"] for r in lines] == list(range(6))
    assert all([t.replace(" ", "") for t in r["text"]] == ["EDGESERVE2026"] for r in lines)
