"""A camera URL's password (rtsp://user:password@host/...) never leaves the watch process: not in
its log lines (FFmpeg's errors quote the URL), not in the last error it keeps, not in /metrics."""

from __future__ import annotations

import logging
import threading

import pytest

pytest.importorskip("av", reason="the [video] extra (PyAV) is not installed")

from edgeserve.metrics import render
from edgeserve.video.metrics import StreamStats, VideoCollector
from edgeserve.video.sources import SourceOptions, SourceThread, parse_source

SECRET = "s3cret-Pa55"


def test_a_camera_password_is_not_logged_or_exported(caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as probe:  # a port with nothing listening: every attempt is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = parse_source(f"door=rtsp://admin:{SECRET}@127.0.0.1:{port}/cam")
    ended = threading.Event()
    options = SourceOptions(open_timeout=2.0, read_timeout=2.0, backoff_initial=0.05, backoff_max=0.1)
    thread = SourceThread(spec, options, lambda item: None, lambda error: ended.set())
    with caplog.at_level(logging.WARNING, logger="edgeserve.video"):
        thread.start()
        for _ in range(200):
            if thread.counters.reconnects >= 2:
                break
            thread.stopping.wait(0.05)
        thread.stop()
        assert ended.wait(30)
    assert thread.counters.reconnects >= 2, "the refused camera was not retried"
    assert caplog.records, "the failures were not logged"
    assert SECRET not in caplog.text and "***@127.0.0.1" in caplog.text
    assert SECRET not in thread.counters.last_error and thread.counters.last_error
    collector = VideoCollector(
        lambda: [(spec.name, 0, {}, 0, thread.counters.reconnects, False, StreamStats())]
    )
    from edgeserve.metrics import register_collector, unregister_collector

    register_collector(collector)
    try:
        text = render([])[0].decode()
    finally:
        unregister_collector(collector)
    assert 'edgeserve_video_reconnects_total{stream="door"}' in text and SECRET not in text
