"""RTSP on loopback (gst-rtsp-server): a real stream over TCP and UDP through the detector, a server
that stalls (SIGSTOP) and one that goes away and comes back: the watch reconnects with backoff, and
a second stream running beside the failing one keeps getting results the whole time."""

from __future__ import annotations

import pytest

pytest.importorskip("av", reason="the [video] extra (PyAV) is not installed")

from typing import Any

from video_clips import expected_boxes, face_inside, quick_sources


def _clip_frames(results: list[Any], fps: int) -> list[int]:
    """Each result's frame of the clip. The server streams the clip in real time from when it prepared
    it, so the first frame a client gets is not the clip's first; the RTP clock (pts, at the clip's
    `fps`) tells which one it is. FFmpeg gives the first frame of each connection no pts: it is placed
    by the next frame that has one (`frame` counts the frames decoded, so the gap is their distance)."""
    placed: list[int] = []
    anchor: tuple[int, int] | None = None  # (frame, clip frame) of the next result with a pts
    for r in reversed(results):
        if r.pts is not None:
            anchor = (r.frame, round(r.pts * fps))
            placed.append(anchor[1])
        else:
            placed.append(anchor[1] - (anchor[0] - r.frame) if anchor is not None else r.frame)
    return placed[::-1]


def _faces_ok(results: list[Any], frames: int = 300, fps: int = 10) -> bool:
    """Each answer right for its frame of the clip, give or take 3 frames."""
    boxes = expected_boxes(frames)
    placed = _clip_frames(results, fps)
    pairs = zip(results, placed, strict=True)
    return all(any(face_inside(r, boxes[(at + d) % frames]) for d in range(-3, 4)) for r, at in pairs)


def test_rtsp_over_tcp_and_udp(clips, rtsp_server, watching) -> None:
    server = rtsp_server(clips["long"])
    h265 = rtsp_server(clips["h265"], "h265")
    udp = quick_sources()
    udp.rtsp_transport = "udp"
    tcp_run = watching([f"tcp={server.url}", f"hevc={h265.url}"])
    udp_run = watching([f"udp={server.url}"], source=udp)
    for run, name in ((tcp_run, "tcp"), (tcp_run, "hevc"), (udp_run, "udp")):
        run.wait(lambda run=run, name=name: len(run.of(name)) >= 8, what=f"8 results from {name}")
    tcp_run.stop()
    udp_run.stop()
    for run, name in ((tcp_run, "tcp"), (udp_run, "udp")):
        results = run.of(name)
        frames = [r.frame for r in results]
        assert frames == sorted(frames) and len(set(frames)) == len(frames)
        assert _faces_ok(results), [r.data for r in results[:3]]
        assert results[0].pts is not None
    assert _faces_ok(tcp_run.of("hevc"), 100)


def test_a_stalled_and_a_vanished_camera_come_back(clips, rtsp_server, watching) -> None:
    flaky = rtsp_server(clips["long"])
    steady = rtsp_server(clips["steady"])
    run = watching([f"flaky={flaky.url}", f"steady={steady.url}"])
    run.wait(lambda: len(run.of("flaky")) >= 3 and len(run.of("steady")) >= 3, what="both streams")
    stream = run.stream("flaky")

    # 1. the stall: the server stops sending (SIGSTOP); the read timeout notices, the watch retries
    flaky.pause()
    run.wait(lambda: stream.thread.counters.reconnects >= 1, what="the stall noticed")
    assert not stream.thread.counters.up
    run.wait_more("steady", 5, "the steady stream going on")
    flaky.resume()
    run.wait_more("flaky", 3, "results after the stall")

    # 2. the server goes away and comes back on the same port
    flaky.stop()
    reconnects = stream.thread.counters.reconnects
    run.wait(lambda: stream.thread.counters.reconnects > reconnects, what="the loss noticed")
    run.wait_more("steady", 5, "the steady stream going on")
    flaky.start()
    run.wait_more("flaky", 3, "results after the server came back")
    run.stop()
    assert stream.thread.counters.reconnects >= 2
    assert run.stream("steady").thread.counters.reconnects == 0
    assert _faces_ok(run.of("steady"), fps=4)
