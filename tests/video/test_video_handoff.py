"""The decoder -> dispatcher hand-off (flow.Mailbox with slots given to the decoder), the conversion
paths (resize in YUV, planar GBR into CHW slots) and the two CenterFace decoders (plain Python for a
few cells, vectorised for many) agreeing; end to end: the decoder threads convert the frames of a
file, and a stream whose resolution grows mid-way gets new rings and every frame still answered."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import video_clips
from es_server import wait_until

from edgeserve.client import FrameRing
from edgeserve.video import flow, results
from edgeserve.video.convert import InputSpec, planes_of, rgb_of, to_array, write_input
from edgeserve.video.flow import Mailbox, Ready
from edgeserve.video.sources import Decoded, parse_sources
from edgeserve.video.stream import Stream


def _item(index: int, t0: float | None = None) -> Decoded:
    return Decoded(None, index, index / 30, 0.0, time.perf_counter() if t0 is None else t0, 4, 4)


class _Recorder:
    """A converter that records which frame went into which slot, on which thread."""

    def __init__(self, fits: bool = True) -> None:
        self.calls: list[tuple[int, Any, str]] = []
        self.fits = fits

    def __call__(self, item: Decoded, slot: Any) -> Ready | None:
        if not self.fits:
            return None
        self.calls.append((item.index, slot, threading.current_thread().name))
        return Ready(item, slot, f"tensor-{item.index}", (4, 4), 0.0)


def test_latest_a_given_slot_takes_the_next_frame_in_the_decoder_thread() -> None:
    woken: list[int] = []
    convert = _Recorder()
    box = Mailbox("latest", None, lambda: woken.append(1), convert)
    box.offer(_item(0))  # no slot yet: kept unconverted, the dispatcher is told
    assert box.unconverted and woken == [1] and box.held == 0
    box.give("slot-a")
    box.feed()
    decoder = threading.Thread(target=box.offer, args=(_item(1),), name="video-cam")
    decoder.start()
    decoder.join()
    assert convert.calls == [(1, "slot-a", "video-cam")]  # converted where it was decoded
    assert box.dropped["stale"] == 1 and not box.unconverted  # frame 0 was left for the newer one
    (ready,) = box.take_ready()
    assert (ready.item.index, ready.tensor) == (1, "tensor-1") and box.held == 0
    box.offer(_item(2))  # no free slot: waits unconverted, replacing nothing
    box.offer(_item(3))  # ... and is replaced by the next (latest-frame policy)
    assert box.take().index == 3 and box.dropped["stale"] == 2  # type: ignore[union-attr]
    box.give("slot-b")
    assert box.reclaim() == ["slot-b"] and not box.feeding


def test_every_waits_for_a_slot_once_fed_and_keeps_the_order() -> None:
    convert = _Recorder()
    box = Mailbox("every", None, lambda: None, convert)
    box.offer(_item(0))  # before any ring: handed over unconverted
    box.feed()
    done = threading.Event()

    def decoder() -> None:
        box.offer(_item(1))  # waits: frame 0 goes first
        box.offer(_item(2))  # waits: every slot is in flight
        done.set()

    thread = threading.Thread(target=decoder, name="video-file")
    thread.start()
    assert not done.wait(0.3) and convert.calls == []
    assert box.take().index == 0  # type: ignore[union-attr]
    box.give("slot-a")
    assert wait_until(lambda: len(convert.calls) == 1)
    assert not done.wait(0.3)  # frame 2 has no slot yet: backpressure, nothing dropped
    box.give("slot-b")
    assert done.wait(10)
    thread.join()
    assert [(i, s) for i, s, _ in convert.calls] == [(1, "slot-a"), (2, "slot-b")]
    assert [r.item.index for r in box.take_ready()] == [1, 2] and box.dropped == {"stale": 0, "fps": 0}
    closed = threading.Event()

    def close() -> None:
        closed.set()
        box.close()

    closer = threading.Timer(0.2, close)
    closer.start()
    box.offer(_item(3))  # fed, no slot: blocks until closed
    assert closed.is_set()
    box.offer(_item(4))  # closed: returns at once, the frame is not kept
    closer.join()
    assert not box.waiting and len(convert.calls) == 2


def test_a_frame_that_outgrew_the_ring_is_handed_over_unconverted() -> None:
    box = Mailbox("latest", None, lambda: None, _Recorder(fits=False))
    box.give("small-slot")
    box.feed()
    box.offer(_item(0))
    assert box.unconverted and not box.feeding  # the dispatcher makes bigger rings for it
    assert box.reclaim() == ["small-slot"] and box.take_ready() == []


def test_the_next_frame_is_expected_at_the_stream_rate() -> None:
    box = Mailbox("latest", None, lambda: None)
    assert box.due_in() == float("inf")  # no rate yet
    now = time.perf_counter()
    for index in range(5):
        box.offer(_item(index, now - 0.2 + index * 0.05))  # 20 fps, the last one 0 s ago
    assert box.interval == pytest.approx(0.05) and box.due_in() == pytest.approx(0.05, abs=0.02)


def _yuv_frame(width: int = 320, height: int = 192) -> tuple[Any, np.ndarray]:
    av = pytest.importorskip("av")
    rgb = next(video_clips.face_frames(1, (width, height)))[0]
    return av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p"), rgb


def test_yuv_frames_are_resized_before_the_colour_conversion() -> None:
    frame, _ = _yuv_frame()
    reference = frame.reformat(160, 96, "rgb24", interpolation="BILINEAR").to_ndarray().astype(np.float32)
    packed = rgb_of(frame, 160, 96).astype(np.float32)
    planes = np.stack(planes_of(frame, 160, 96)).astype(np.float32)
    bgr = np.stack(planes_of(frame, 160, 96, bgr=True))
    # The same picture: swscale's fast bilinear rounds differently by a level or two per pixel
    # (mean 3.2 here); swapped channels differ by 15 and a picture 8 pixels off by 21.
    assert np.abs(packed - reference).mean() < 6
    assert np.abs(packed[..., ::-1] - reference).mean() > 10
    np.testing.assert_array_equal(planes, packed.transpose(2, 0, 1))  # R, G, B planes
    np.testing.assert_array_equal(bgr, planes[::-1])
    face = InputSpec("image", "FP32", "CHW", True, None, None, scale=0.5)
    with FrameRing(1, 4 * 3 * 160 * 96) as ring:
        slot = ring.acquire()
        ref = write_input(frame, slot, face, 160, 96)
        sent = ring.read(slot, "FP32", ref.shape, ref.byte_size)
        np.testing.assert_allclose(sent[0], planes * 0.5)
        np.testing.assert_array_equal(to_array(frame, face, 160, 96), sent)
        hwc = InputSpec("x", "FP16", "HWC", True, None, None)
        ref = write_input(frame, slot, hwc, 160, 96)
        np.testing.assert_array_equal(ring.read(slot, "FP16", ref.shape, ref.byte_size)[0], packed)
        chw8 = InputSpec("x", "UINT8", "CHW", False, None, None)
        ref = write_input(frame, slot, chw8, 160, 96)
        np.testing.assert_array_equal(ring.read(slot, "UINT8", ref.shape, ref.byte_size), planes)


@pytest.mark.parametrize("cells", [3, 30, 200])
def test_centerface_decoders_agree(cells: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(cells)
    heat = rng.uniform(0, 0.4, (1, 1, 48, 80)).astype(np.float32)
    heat[0, 0, rng.integers(0, 48, cells), rng.integers(0, 80, cells)] = rng.uniform(0.5, 1, cells)
    outputs = {
        "heatmap": heat,
        "scale": rng.normal(2.5, 0.5, (1, 2, 48, 80)).astype(np.float32),
        "offset": rng.uniform(0, 1, (1, 2, 48, 80)).astype(np.float32),
    }
    python = results.interpret(outputs, (320, 192), (1280, 720))
    monkeypatch.setattr(results, "SMALL_DECODE", -1)
    vectorised = results.interpret(outputs, (320, 192), (1280, 720))
    assert python["labels"] == vectorised["labels"] and python["labels"]
    np.testing.assert_allclose(python["boxes"], vectorised["boxes"], atol=0.011)
    np.testing.assert_allclose(python["scores"], vectorised["scores"], atol=0.011)


def test_the_decoder_threads_convert_a_files_frames(clips, watching, monkeypatch) -> None:
    threads: list[str] = []
    real = flow.write_input

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(flow, "write_input", spy)
    run = watching([f"clip={clips['h264']}"], inflight=2)
    run.join()
    assert [r.frame for r in run.of("clip")] == list(range(60))
    # The first frames come before the ring exists; every later one is converted where it was decoded.
    assert len(threads) == 60 and threads[3:] == ["video-clip"] * 57


def test_a_stream_whose_frames_grow_gets_new_rings(watching, tmp_path: Path) -> None:
    parts = []
    for name, size in (("small", (320, 192)), ("large", (640, 384))):
        frames = (f for f, _ in video_clips.face_frames(12, size))
        parts.append(
            video_clips.ts_copy(video_clips.encode(tmp_path / f"{name}.mkv", frames), tmp_path / f"{name}.ts")
        )
    clip = tmp_path / "grows.ts"
    clip.write_bytes(b"".join(p.read_bytes() for p in parts))  # MPEG-TS concatenates
    run = watching([f"cam={clip}"])
    run.join()
    got = run.of("cam")
    assert [r.frame for r in got] == list(range(24)) and run.failed == 0
    assert {(r.width, r.height) for r in got[:12]} == {(320, 192)}
    assert {(r.width, r.height) for r in got[12:]} == {(640, 384)}
    boxes = video_clips.expected_boxes(12) + video_clips.expected_boxes(12, (640, 384))
    wrong = [r.frame for r, box in zip(got, boxes, strict=True) if not video_clips.face_inside(r, box)]
    assert not wrong, f"frames with a wrong answer: {wrong}"
    assert len(run.stream("cam").rings) == 2


def test_answers_go_out_in_the_order_their_frames_were_sent() -> None:
    stream = Stream(parse_sources([f"cam={__file__}"])[0], "every")
    first, second, third = stream.sent(), stream.sent(), stream.sent()
    assert stream.answered(second, "b") == []  # a second model instance answered first: it waits
    assert stream.answered(first, "a") == ["a", "b"]
    fourth = stream.sent()
    assert stream.answered(third, None) == []  # no answer (a failed request) holds nothing up
    assert stream.answered(fourth, "d") == ["d"]


def test_a_hushed_mailbox_keeps_frames_without_waking_the_dispatcher() -> None:
    woken: list[int] = []
    box = Mailbox("latest", None, lambda: woken.append(1))
    box.hush()  # every slot in flight: the dispatcher looks when one comes back
    box.offer(_item(0))
    assert box.unconverted and woken == []
    box.hush(False)
    assert box.take().index == 0  # type: ignore[union-attr]
    box.offer(_item(1))
    assert woken == [1]
