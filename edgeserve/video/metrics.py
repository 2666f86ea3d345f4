"""Per-stream Prometheus metrics of `edgeserve watch`, on its own `/metrics` endpoint.

The watch process is not the server, so it serves its own scrape target (default
127.0.0.1:8003, next to the server's 8000/8001 and Triton's 8002; `--metrics off` for none)
with the same renderer as the server's (`edgeserve.metrics.render`, which adds these
collectors to the process gauges). Pushing into the server was the alternative: it would need
a write API on the server for a process that shares nothing else with it, and the series would
vanish with a server restart. Scrape both targets.

    edgeserve_video_frames_decoded_total{stream}
    edgeserve_video_frames_dropped_total{stream, reason}   stale | fps | server | failed
    edgeserve_video_frames_inferred_total{stream}
    edgeserve_video_corrupt_total{stream}     packets or frames damaged or refused by the decoder
    edgeserve_video_reconnects_total{stream}
    edgeserve_video_stream_up{stream}
    edgeserve_video_latency_seconds{stream} (histogram: decode to result)
"""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("edgeserve.video")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class StreamStats:
    """Counters the dispatcher keeps per stream (the decoder's own live in SourceCounters)."""

    inferred: int = 0
    failed: int = 0
    rejected: int = 0  # the server's queue was full (UNAVAILABLE): the frame is dropped
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    latencies: list[float] = field(default_factory=list)  # recent, for the summary line
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, seconds: float) -> None:
        with self.lock:
            self.inferred += 1
            self.latency_sum += seconds
            index = next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
            self.latency_counts[index] += 1
            self.latencies.append(seconds)
            if len(self.latencies) > 10000:
                del self.latencies[:5000]


class VideoCollector(Collector):
    """Reads `snapshot()`: [(stream, decoded, dropped{reason: n}, corrupt, reconnects, up, StreamStats)]."""

    def __init__(
        self, snapshot: Callable[[], Iterable[tuple[str, int, dict[str, int], int, int, bool, StreamStats]]]
    ) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        labels = ["stream"]
        decoded = CounterMetricFamily("edgeserve_video_frames_decoded", "Frames decoded", labels=labels)
        dropped = CounterMetricFamily(
            "edgeserve_video_frames_dropped",
            "Decoded frames not inferred, by reason",
            labels=["stream", "reason"],
        )
        inferred = CounterMetricFamily(
            "edgeserve_video_frames_inferred", "Frames with a result", labels=labels
        )
        corrupt = CounterMetricFamily(
            "edgeserve_video_corrupt", "Packets or frames damaged or refused by the decoder", labels=labels
        )
        reconnects = CounterMetricFamily(
            "edgeserve_video_reconnects", "Times the source was opened again", labels=labels
        )
        up = GaugeMetricFamily(
            "edgeserve_video_stream_up", "1 while the source delivers frames", labels=labels
        )
        latency = HistogramMetricFamily(
            "edgeserve_video_latency_seconds", "Decode to result, per frame", labels=labels
        )
        for name, n_decoded, n_dropped, n_corrupt, n_reconnects, is_up, stats in self._snapshot():
            decoded.add_metric([name], n_decoded)
            for reason, count in n_dropped.items():
                dropped.add_metric([name, reason], count)
            inferred.add_metric([name], stats.inferred)
            corrupt.add_metric([name], n_corrupt)
            reconnects.add_metric([name], n_reconnects)
            up.add_metric([name], 1.0 if is_up else 0.0)
            with stats.lock:
                counts, total = list(stats.latency_counts), stats.latency_sum
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            latency.add_metric([name], buckets, total)
        yield from (decoded, dropped, inferred, corrupt, reconnects, up, latency)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        from edgeserve.metrics import render

        if self.path.split("?")[0] != "/metrics":
            self.send_error(404, "only /metrics here")
            return
        body, content_type = render([])
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(host: str, port: int) -> http.server.ThreadingHTTPServer | None:
    """Serve /metrics on host:port in a daemon thread; None (with a warning) when the port is taken."""
    try:
        server = http.server.ThreadingHTTPServer((host, port), _Handler)
    except OSError as exc:
        log.warning(
            "watch metrics: cannot listen on %s:%d (%s); no /metrics for this process", host, port, exc
        )
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="video-metrics", daemon=True).start()
    return server
