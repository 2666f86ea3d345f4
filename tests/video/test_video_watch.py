"""`edgeserve watch` end to end against a real server: H.264 and H.265 files encoded in the test
through the CenterFace detector (answers checked against where the portrait is), the OCR ensemble,
several streams at once with a corrupt one among them, results over MQTT (real mosquitto) and
ZeroMQ PUB, the per-stream /metrics, the overlay video, and the command's exit codes and Ctrl-C."""

from __future__ import annotations

import pytest

pytest.importorskip("av", reason="the [video] extra (PyAV) is not installed")

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import zmq
from es_server import ROOT, free_port, wait_until
from video_clips import OCR_TEXT, expected_boxes, face_inside

from edgeserve.video import open_sink


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeserve", "watch", *args, "--metrics", "off"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.parametrize("codec", ["h264", "h265"])
def test_a_file_through_the_face_detector_every_frame_in_order(codec, clips, watching) -> None:
    run = watching([f"clip={clips[codec]}"])
    run.join()
    results = run.of("clip")
    frames = 60 if codec == "h264" else 40
    assert [r.frame for r in results] == list(range(frames))  # every-frame policy for files: all, in order
    boxes = expected_boxes(frames)
    wrong = [r.frame for r, box in zip(results, boxes, strict=True) if not face_inside(r, box)]
    assert not wrong, f"frames with a wrong answer: {wrong}: {[results[i].data for i in wrong[:3]]}"
    assert results[1].pts == pytest.approx(0.1) and results[0].width == 320 and results[0].height == 192
    assert all(r.data["labels"] == ["face"] * len(r.boxes) for r in results)
    assert run.failed == 0


def test_the_ocr_ensemble_reads_the_text(clips, watching) -> None:
    run = watching([f"sign={clips['text']}"], model="ocr", max_frames=2)
    run.join()
    results = run.of("sign")
    assert len(results) == 2
    for result in results:
        assert [t.replace(" ", "") for t in result.data["text"]] == [OCR_TEXT.replace(" ", "")]
        (corners,) = result.data["boxes"]
        assert len(corners) == 4 and 0 <= corners[0][0] < 100 and corners[2][0] > 300


def test_fixed_fps_and_a_corrupt_stream_next_to_a_good_one(clips, watching) -> None:
    run = watching([f"good={clips['h264']}", f"bad={clips['corrupt']}"], fps=2.0)
    run.join()
    good = run.of("good")
    assert [r.frame for r in good] == list(range(0, 60, 5))  # 10 fps clip, 2 fps kept by pts
    boxes = expected_boxes(60)
    assert all(face_inside(r, boxes[r.frame]) for r in good)
    bad = run.stream("bad")
    assert bad.thread.counters.corrupt > 0  # damage seen and counted ...
    assert run.of("bad") and bad.mailbox.dropped["fps"] > 0  # ... and the frames still decodable flow
    assert run.stream("good").thread.counters.corrupt == 0


def test_results_over_mqtt_and_zeromq_and_metrics(clips, watching, tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "fleet"))
    from broker import Mosquitto, find_mosquitto

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (scripts/test.sh installs it)")
    import paho.mqtt.client as mqtt

    broker = Mosquitto(tmp_path / "broker").start()
    received: list[tuple[str, dict]] = []
    subscriber = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="video-test-sub")
    subscriber.on_message = lambda c, u, m: received.append((m.topic, json.loads(m.payload)))
    subscriber.connect("127.0.0.1", broker.port)
    subscriber.subscribe("edgeserve/video/#")
    subscriber.loop_start()
    zport = free_port()
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{zport}")
    sinks = [open_sink(f"mqtt://127.0.0.1:{broker.port}"), open_sink(f"zmq://127.0.0.1:{zport}")]
    try:
        assert wait_until(lambda: sinks[0]._client.is_connected(), 20)  # type: ignore[attr-defined]
        from edgeserve.metrics import register_collector, unregister_collector
        from edgeserve.video.metrics import serve_metrics

        run = watching([f"door={clips['h264']}"], sinks=sinks)
        register_collector(run.watch.collector)
        mport = free_port()
        exporter = serve_metrics("127.0.0.1", mport)
        assert exporter is not None
        zmq_messages = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while run.thread.is_alive() or poller.poll(200):
            if poller.poll(200):
                zmq_messages.append(sub.recv_multipart())
        run.join()
        assert wait_until(lambda: len(received) >= 60, 20)
        topics = {t for t, _ in received}
        assert topics == {"edgeserve/video/door"}
        first = min((m for _, m in received), key=lambda m: m["frame"])
        assert (
            first["schema"] == "edgeserve.video.result/1"
            and first["stream"] == "door"
            and first["frame"] == 0
        )
        assert (
            first["labels"] == ["face"] and len(first["boxes"][0]) == 4 and "time" in first and "pts" in first
        )
        assert zmq_messages and all(m[0] == b"door" for m in zmq_messages)
        assert json.loads(zmq_messages[-1][1])["stream"] == "door"
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'edgeserve_video_frames_inferred_total{stream="door"} 60.0' in text
        assert 'edgeserve_video_frames_decoded_total{stream="door"} 60.0' in text
        assert 'edgeserve_video_latency_seconds_count{stream="door"} 60.0' in text
        exporter.shutdown()
        unregister_collector(run.watch.collector)
    finally:
        subscriber.loop_stop()
        subscriber.disconnect()
        sub.close(linger=0)
        broker.stop()


def test_cli_overlay_exit_codes_and_ctrl_c(clips, video_server, tmp_path) -> None:
    endpoint = ["--endpoint", video_server.zmq_endpoint]
    out = tmp_path / "overlay.mp4"
    done = _cli(
        str(clips["h264"]), "--model", "centerface", *endpoint, "--overlay", str(out), "--max-frames", "10"
    )
    assert done.returncode == 0, done.stderr
    assert "stream0: " in done.stderr and "10 inferred" in done.stderr
    import av

    with av.open(str(out)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 10
    for args, message in [
        (["nope.mp4", "--model", "centerface"], "no such file nope.mp4"),
        (["bogus://x", "--model", "centerface"], "unsupported URL scheme"),
        ([str(clips["h264"]), "--model", "no_such_model"], "unknown model 'no_such_model'"),
        ([str(clips["h264"]), "--model", "centerface", "--publish", "nats://x"], "unsupported"),
    ]:
        failed = _cli(*args, *endpoint)
        lines = failed.stderr.strip().splitlines()
        assert failed.returncode == 2 and len(lines) == 1 and message in lines[0], failed.stderr
    # Ctrl-C: a file played as a camera, forever; SIGINT stops it cleanly (results in flight arrive)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgeserve",
            "watch",
            f"loop={clips['h264']}",
            "--model",
            "centerface",
            *endpoint,
            "--realtime",
            "--loop",
            "--print",
            "--metrics",
            "off",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert process.stdout is not None
    first = json.loads(process.stdout.readline())
    assert first["stream"] == "loop"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "loop: " in stderr and "inferred" in stderr


def test_missing_extra_message(tmp_path: Path) -> None:
    """Without PyAV the command says which extra to install (exit 2)."""
    blocker = tmp_path / "av.py"
    blocker.write_text("raise ImportError('blocked for the test')\n")
    env = {"PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "edgeserve", "watch", "x.mp4", "--model", "m"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2 and "pip install 'edgeserve[video]'" in done.stderr
