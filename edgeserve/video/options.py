"""What a watch is asked to do (`WatchOptions`), and the error of a model it cannot watch."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeserve.video.sources import SourceOptions


class WatchError(Exception):
    """The model cannot be watched as asked (unknown model, not an image model): exit 2."""


@dataclass
class WatchOptions:
    model: str
    version: str = ""
    endpoint: str = ""  # "": the appliance's, as its settings say (edgeserve.client.find_endpoint)
    policy: str | None = None  # None: latest for live sources, every for files
    fps: float | None = None
    # Requests in flight per stream (its ring's slots). 0: 2 for a single stream (the next frame
    # waits at the server while one runs), 1 for several (the other streams keep the model busy,
    # and a frame queued behind its own stream's is a stale one).
    inflight: int = 0
    size: tuple[int, int] | None = None  # (width, height) for dynamic model inputs
    scale: float = 1.0
    bgr: bool = False
    threshold: float = 0.5
    timeout: float = 10.0
    max_frames: int = 0  # results per stream, then that stream stops (0 = no limit)
    source: SourceOptions = field(default_factory=SourceOptions)
