"""Camera and video pipelines: sources (files, RTSP, V4L2, GStreamer) decoded with FFmpeg (PyAV)
into shared-memory ring slots, flow control per stream, many streams into one model's batcher, and
results out to callbacks, ZeroMQ PUB and MQTT. `edgeserve watch` is the command line for it.

Needs the `[video]` extra (PyAV, Pillow for overlays). Importing this package does not import PyAV.

    from edgeserve.video import Watch, WatchOptions, parse_sources
    Watch(parse_sources(["cam=rtsp://127.0.0.1:8554/cam"]), WatchOptions(model="centerface"),
          on_result=lambda r: print(r.to_dict())).run()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeserve.video.options import WatchError, WatchOptions
    from edgeserve.video.pipeline import Watch
    from edgeserve.video.publish import CallbackSink, MqttSink, Sink, ZmqPubSink, open_sink
    from edgeserve.video.results import SCHEMA, Result
    from edgeserve.video.sources import SourceError, SourceOptions, SourceSpec, parse_source, parse_sources

# Imported on first use: `edgeserve.video.cli` is imported by every `edgeserve` command's parser.
_HOME = {
    "Watch": "pipeline",
    **dict.fromkeys(("WatchError", "WatchOptions"), "options"),
    **dict.fromkeys(("CallbackSink", "MqttSink", "Sink", "ZmqPubSink", "open_sink"), "publish"),
    **dict.fromkeys(("SCHEMA", "Result"), "results"),
    **dict.fromkeys(
        ("SourceError", "SourceOptions", "SourceSpec", "parse_source", "parse_sources"), "sources"
    ),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'edgeserve.video' has no attribute {name!r}")
    return getattr(importlib.import_module(f"edgeserve.video.{home}"), name)


__all__ = [
    "SCHEMA",
    "CallbackSink",
    "MqttSink",
    "Result",
    "Sink",
    "SourceError",
    "SourceOptions",
    "SourceSpec",
    "Watch",
    "WatchError",
    "WatchOptions",
    "ZmqPubSink",
    "open_sink",
    "parse_source",
    "parse_sources",
]
