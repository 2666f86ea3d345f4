"""`edgeserve watch SOURCE... --model NAME [--fps N] [--policy latest|every] [--publish URL]
[--overlay out.mp4]`: decode streams into the local appliance's model and send the results out.

The appliance is found as the other commands find it: `--endpoint`, else the first ZeroMQ endpoint
of the settings (`--config`, $CONFIGURATION_DIRECTORY/edgeserve.toml, /etc/edgeserve/edgeserve.toml,
EDGESERVE_ZMQ_ENDPOINTS), else the default socket where the server puts it (docs/zmq.md); an ipc
socket that is not the server's user's is refused. Exit status: 0 when every stream ended (or Ctrl-C),
1 when a stream failed or the appliance cannot be reached, 2 for a bad SOURCE or --publish URL,
a missing file or device, an unknown model, or a model that does not take images.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

# Only the standard library's lightest modules at import time: every `edgeserve` command builds
# this parser. asyncio, logging and PyAV come when `watch` runs.

METRICS_DEFAULT = "127.0.0.1:8003"


def add_commands(sub: Any) -> None:
    watch = sub.add_parser(
        "watch",
        help="decode video streams into a model; publish the results",
        description=__doc__.split("\n\n")[0],
    )
    watch.add_argument(
        "sources", nargs="+", metavar="SOURCE", help="[NAME=]file | rtsp://... | /dev/videoN | gst:PIPELINE"
    )
    watch.add_argument("--model", required=True, help="the model to run on each frame")
    watch.add_argument("--model-version", default="", help="default: the model's latest version")
    watch.add_argument("--fps", type=float, help="at most N frames/s per stream go to the model")
    watch.add_argument(
        "--policy",
        choices=["latest", "every"],
        help="when the model lags: drop stale frames (default for live sources) or wait (default for files)",
    )
    watch.add_argument(
        "--publish",
        action="append",
        default=[],
        metavar="URL",
        help="mqtt[s]://[user:pass@]host[:port][/prefix] | zmq://host:port | zmq:///path (repeatable)",
    )
    watch.add_argument("--overlay", type=Path, metavar="OUT.mp4", help="write the video with results drawn")
    watch.add_argument("--print", action="store_true", help="print each result as a JSON line on stdout")
    watch.add_argument("--endpoint", help="the appliance's ZeroMQ endpoint (default: from the settings)")
    watch.add_argument("--config", type=Path, help="settings TOML file (for the endpoint)")
    watch.add_argument("--size", help="WxH the frames are resized to, for models with dynamic sizes")
    watch.add_argument("--scale", type=float, default=1.0, help="factor on pixel values for float inputs")
    watch.add_argument("--bgr", action="store_true", help="the model wants BGR, not RGB")
    watch.add_argument("--threshold", type=float, default=0.5, help="detector score threshold")
    watch.add_argument(
        "--inflight",
        type=int,
        default=0,
        help="requests in flight per stream (default: 2 for one stream, 1 for several)",
    )
    watch.add_argument("--rtsp-transport", choices=["tcp", "udp"], default="tcp")
    watch.add_argument("--read-timeout", type=float, default=5.0, help="seconds without data: reconnect")
    watch.add_argument("--realtime", action="store_true", help="play files at their own frame rate")
    watch.add_argument("--loop", action="store_true", help="play files again at their end")
    watch.add_argument("--max-frames", type=int, default=0, help="stop each stream after N results")
    watch.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for one result")
    watch.add_argument(
        "--metrics",
        default=METRICS_DEFAULT,
        metavar="HOST:PORT|off",
        help=f"serve this process's /metrics (default {METRICS_DEFAULT})",
    )
    watch.set_defaults(func=watch_command)


def _fail(message: str, code: int = 2) -> int:
    print(f"edgeserve watch: {message}", file=sys.stderr)
    return code


def _endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        return str(args.endpoint)
    from edgeserve.client.endpoint import find_endpoint

    return find_endpoint(args.config)


def _size(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
        raise ValueError(f"--size {text!r}: expected WxH, e.g. 640x384")
    return int(width), int(height)


def watch_command(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    try:
        import av  # noqa: F401
    except ImportError:
        return _fail("needs PyAV (FFmpeg): pip install 'edgeserve[video]'")
    from edgeserve.bench.options import from_args
    from edgeserve.client.errors import ClientError
    from edgeserve.video.options import WatchError, WatchOptions
    from edgeserve.video.pipeline import Watch
    from edgeserve.video.publish import CallbackSink, Sink, open_sink
    from edgeserve.video.sources import SourceError, SourceOptions, parse_sources

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    sinks: list[Sink] = []
    try:
        specs = parse_sources(args.sources)
        size = _size(args.size)
        if args.fps is not None and args.fps <= 0:
            raise ValueError(f"--fps must be > 0, not {args.fps}")
        if args.inflight < 0:
            raise ValueError(f"--inflight must be >= 1, not {args.inflight}")
        if any(s.kind == "gst" for s in specs):
            from edgeserve.video.gst import available

            problem = available()
            if problem is not None:
                raise SourceError(f"gst: sources need GStreamer: {problem}")
        endpoint = _endpoint(args)
        sinks = [open_sink(url) for url in args.publish]
    except (SourceError, ValueError) as exc:
        for sink in sinks:
            sink.close()
        return _fail(str(exc))
    if args.print:
        sinks.append(CallbackSink(lambda r: print(r.to_json().decode(), flush=True)))
    options = from_args(
        WatchOptions,
        args,
        version=args.model_version,
        endpoint=endpoint,
        size=size,
        source=from_args(SourceOptions, args),
    )
    overlay = None
    if args.overlay is not None:
        from edgeserve.video.overlay import OverlayWriter, overlay_path

        base = args.overlay
        overlay = lambda spec: OverlayWriter(overlay_path(base, spec, len(specs)))  # noqa: E731
    watch = Watch(specs, options, sinks=sinks, overlay=overlay)
    metrics = _metrics(args.metrics, watch)
    try:
        failed = asyncio.run(_run(watch))
    except WatchError as exc:
        return _fail(str(exc))
    except ClientError as exc:
        return _fail(f"cannot use edgeserve at {endpoint}: {exc.message} (is `edgeserve run` serving it?)", 1)
    finally:
        if metrics is not None:
            metrics.shutdown()
    _summary(watch)
    return 1 if failed else 0


async def _run(watch: Any) -> int:
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    interrupts = 0

    def interrupted() -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:  # a second Ctrl-C: do not wait for results in flight
            os._exit(130)
        print("edgeserve watch: stopping (Ctrl-C again to quit at once)", file=sys.stderr)
        watch.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted)
    return int(await watch.main())


def _metrics(where: str, watch: Any) -> Any:
    if where.lower() in ("off", "none", ""):
        return None
    from edgeserve.metrics import register_collector
    from edgeserve.video.metrics import serve_metrics

    host, _, port = where.rpartition(":")
    register_collector(watch.collector)
    return serve_metrics(host.strip("[]") or "127.0.0.1", int(port))


def _summary(watch: Any) -> None:
    for stream in watch.streams:
        if not hasattr(stream, "thread"):
            continue
        name, decoded, dropped, corrupt, reconnects, _, stats = stream.snapshot()
        ordered = sorted(stats.latencies)
        drops = ", ".join(f"{k} {v}" for k, v in dropped.items() if v) or "none"
        latency = "no results"
        if ordered:
            p50, p99 = (ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e3 for q in (0.5, 0.99))
            latency = f"latency p50 {p50:.1f} ms p99 {p99:.1f} ms"
        print(
            f"{name}: {decoded} decoded, {stats.inferred} inferred, dropped: {drops}; {latency}; "
            f"{corrupt} corrupt, {reconnects} reconnects",
            file=sys.stderr,
        )
