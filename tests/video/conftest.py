"""Fixtures of the video tests: clips encoded here, one real edgeserve server (centerface + ocr) for
the session, a loopback RTSP server (gst-rtsp-server under Debian's python3), and `watching(...)`,
which runs a Watch in a thread and collects its results."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import video_clips  # noqa: E402
from es_server import ROOT, RunningServer, free_port, start_server, wait_until  # noqa: E402
from video_clips import quick_sources  # noqa: E402

from edgeserve.video import Result, Watch, WatchOptions, parse_sources  # noqa: E402

MODELS = ROOT / "models"
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="session")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("clips")
    faces = [f for f, _ in video_clips.face_frames(300)]
    made = {
        "h264": video_clips.encode(folder / "face.mkv", iter(faces[:60])),
        "h265": video_clips.encode(folder / "face265.mkv", iter(faces[:40]), "libx265"),
        "long": video_clips.encode(folder / "long.mkv", iter(faces)),
        # the 300 frames four times at 4 frames/s: 300 s, far longer than any test watches it, so a
        # steady stream never reaches its end
        "steady": video_clips.encode(folder / "steady.mkv", iter(faces * 4), fps=4),
        "text": video_clips.encode(folder / "text.mkv", video_clips.text_frames(6)),
    }
    made["ts"] = video_clips.ts_copy(made["h264"], folder / "face.ts")
    made["corrupt"] = video_clips.corrupt(made["ts"], folder / "corrupt.ts")
    return made


@pytest.fixture(scope="session")
def video_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    needed = [MODELS / "centerface" / "1" / "model.onnx", MODELS / "ppocr_det" / "1" / "model.onnx"]
    missing = [str(p.relative_to(ROOT)) for p in needed if not p.exists()]
    if missing:
        pytest.skip(f"sample models missing ({', '.join(missing)}): run `edgeserve samples`")
    server = start_server(
        MODELS,
        tmp_path_factory.mktemp("video-server"),
        args=["--load-model", "centerface", "--load-model", "ocr"],
        timeout=300,
    )
    yield server
    server.stop()


class Watching:
    """A Watch running in a thread; `results` fills as they arrive."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.results: list[Result] = []
        self.failed: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.failed = self.watch.run()
        except BaseException as exc:
            self.error = exc

    def of(self, stream: str) -> list[Result]:
        return [r for r in list(self.results) if r.stream == stream]

    def wait(self, predicate: Callable[[], object], timeout: float = 60.0, what: str = "") -> None:
        assert wait_until(lambda: predicate() or not self.thread.is_alive(), timeout) and predicate(), (
            f"timed out waiting for {what or predicate}; error {self.error!r}"
        )

    def wait_more(self, stream: str, count: int, what: str) -> None:
        """Until `count` more results of `stream` than it has now have come."""
        before = len(self.of(stream))
        self.wait(lambda: len(self.of(stream)) >= before + count, what=what)

    def join(self, timeout: float = 90.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the watch did not finish"
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.watch.started.wait(30)
        self.watch.stop()
        self.join()

    def stream(self, name: str) -> Any:
        return next(s for s in self.watch.streams if s.spec.name == name)


@pytest.fixture
def watching(video_server: RunningServer) -> Iterator[Callable[..., Watching]]:
    running: list[Watching] = []

    def start(sources: list[str], model: str = "centerface", **kwargs: Any) -> Watching:
        sinks = kwargs.pop("sinks", [])
        options = WatchOptions(
            model=model,
            endpoint=video_server.zmq_endpoint,
            timeout=60.0,
            source=kwargs.pop("source", quick_sources()),
            **kwargs,
        )
        holder: list[Watching] = []
        watch = Watch(
            parse_sources(sources), options, sinks=sinks, on_result=lambda r: holder[0].results.append(r)
        )
        holder.append(Watching(watch))
        holder[0].thread.start()
        running.append(holder[0])
        return holder[0]

    yield start
    for item in running:
        if item.thread.is_alive():
            item.watch.stop()
            item.thread.join(60)


class RtspServer:
    def __init__(self, clip: Path, codec: str = "h264") -> None:
        self.clip, self.codec = clip, codec
        self.port = free_port()
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def start(self) -> RtspServer:
        command = [
            SYSTEM_PYTHON,
            str(HERE / "rtsp_server.py"),
            "--port",
            str(self.port),
            "--file",
            str(self.clip),
            "--codec",
            self.codec,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.strip() == "ready", (
            f"RTSP server: {line}{self.process.stdout.read() if self.process.poll() else ''}"
        )
        return self

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def rtsp_problem() -> str | None:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is missing (the RTSP server runs with Debian's python3 and its gi bindings)"
    probe = subprocess.run(
        [
            SYSTEM_PYTHON,
            "-c",
            "import gi; gi.require_version('GstRtspServer', '1.0'); "
            "from gi.repository import GstRtspServer, Gst; Gst.init(None); "
            "assert Gst.ElementFactory.find('matroskademux') and Gst.ElementFactory.find('rtph265pay')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        return (
            "gst-rtsp-server is not installed (scripts/test.sh installs it: gstreamer1.0-rtsp, "
            "gir1.2-gst-rtsp-server-1.0, python3-gi, gstreamer1.0-plugins-good/-bad)"
        )
    return None


@pytest.fixture
def rtsp_server() -> Iterator[Callable[..., RtspServer]]:
    problem = rtsp_problem()
    if problem is not None:
        pytest.skip(problem)
    started: list[RtspServer] = []

    def factory(clip: Path, codec: str = "h264") -> RtspServer:
        server = RtspServer(clip, codec).start()
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
