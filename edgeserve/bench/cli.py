"""`edgeserve bench` and `edgeserve tune`: their flags and what runs them.

Only the standard library at import time: `edgeserve --help` builds these parsers without loading
numpy, grpc or the bench engine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

PROTOCOL_NAMES = ("http", "http-json", "grpc", "grpc-stream", "zmq", "zmq-shm")


def parse_levels(text: str) -> list[int]:
    """`1,2,4,8`, `start:end[:step]` (end included, as perf_analyzer's --concurrency-range) or both."""
    levels: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            if ":" in part:
                bits = [int(b) for b in part.split(":")]
                if len(bits) not in (2, 3) or (len(bits) == 3 and bits[2] <= 0):
                    raise ValueError
                start, end, step = bits[0], bits[1], bits[2] if len(bits) == 3 else 1
                levels += list(range(start, end + 1, step))
            else:
                levels.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected N, N,M,... or start:end[:step]") from None
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: concurrency levels must be 1 or more")
    return levels


def parse_protocols(text: str) -> list[str]:
    protocols = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in protocols if p not in PROTOCOL_NAMES]
    if not protocols or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: protocols are {', '.join(PROTOCOL_NAMES)}")
    return list(dict.fromkeys(protocols))


def _address(args: argparse.Namespace, protocol: str) -> str:
    if args.url:
        return str(args.url)
    if protocol.startswith("http"):
        return str(args.http_url)
    return str(args.grpc_url) if protocol.startswith("grpc") else str(args.zmq_url)


def parse_headers(flags: list[str]) -> dict[str, str]:
    from edgeserve.bench.errors import BenchError

    headers: dict[str, str] = {}
    for flag in flags:
        name, sep, value = flag.partition(":")
        if not sep or not name.strip():
            raise BenchError(f"-H {flag!r}: expected NAME:VALUE")
        headers[name.strip()] = value.strip()
    return headers


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected requests/s values like 100,200") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: request rates must be above 0")
    return rates


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-b", "--batch-size", type=int, default=1, help="inputs per request (default 1)")
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME:D1,D2",
        help="dims of a dynamic input, batch dimension left out (repeatable)",
    )
    parser.add_argument(
        "--input-data",
        action="append",
        metavar="random|zeros|PATH",
        help="random (default), zeros, or .npy / raw / image files or folders (repeatable)",
    )
    parser.add_argument(
        "--warmup-s", type=float, help="load before measuring each point (bench 1 s, tune 0.5 s)"
    )
    parser.add_argument("--window-s", type=float, help="one measurement window (bench 2 s, tune 1 s)")
    parser.add_argument(
        "--stability-pct",
        type=float,
        default=10.0,
        help="last 3 windows' throughput and latency within this %% (default 10)",
    )
    parser.add_argument("--max-windows", type=int, help="windows per point at most (bench 10, tune 4)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="one request's time limit (default 30)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def add_commands(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure a running server (perf_analyzer for the device)",
        description="Load a KServe V2 server (edgeserve or any other) over one protocol and report "
        "throughput, latency percentiles, the server-side queue/compute split and the client's CPU.",
    )
    bench.add_argument("model")
    bench.add_argument(
        "-i",
        "--protocol",
        type=parse_protocols,
        default=["grpc"],
        help=f"{', '.join(PROTOCOL_NAMES)}; several, comma-separated, run one after the other (default grpc)",
    )
    bench.add_argument("-u", "--url", default="", help="the server's address for the one protocol given")
    bench.add_argument("--http-url", default="127.0.0.1:8000", help="HTTP address (default 127.0.0.1:8000)")
    bench.add_argument("--grpc-url", default="127.0.0.1:8001", help="gRPC address (default 127.0.0.1:8001)")
    bench.add_argument("--zmq-url", default="", help="ZeroMQ endpoint (default: from the settings)")
    bench.add_argument(
        "--stats-url",
        default="",
        help="ZeroMQ only: HTTP address for the config and statistics (default --http-url; 'none': without)",
    )
    bench.add_argument(
        "-H",
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="HTTP header / gRPC metadata on every call, e.g. an access token (repeatable)",
    )
    bench.add_argument("--model-version", default="")
    bench.add_argument("--concurrency", type=parse_levels, help="1,2,4,8 or start:end[:step] (default 1)")
    bench.add_argument(
        "--request-rate", type=parse_rates, help="Poisson arrivals at these requests/s (open loop)"
    )
    _common(bench)
    bench.add_argument(
        "--max-seconds", type=float, default=300.0, help="whole run's time limit (default 300)"
    )
    bench.add_argument("--csv", type=Path, help="write the points as CSV")
    bench.add_argument("--json", type=Path, help="write the points and the run as JSON")
    bench.add_argument("--plot", type=Path, help="write latency against throughput as PNG (needs matplotlib)")
    bench.set_defaults(func=bench_command)

    tune = sub.add_parser(
        "tune",
        help="search configs for a latency budget on this device (Model Analyzer for the device)",
        description="Start a server on loopback, load candidate configs of MODEL (backend, precision, "
        "instances, threads, max batch size, queue delay), measure each with a short concurrency sweep, "
        "print the throughput / p99 frontier and write the best config.pbtxt within the budget. Resumable.",
    )
    tune.add_argument("model", help="model name in --model-repository, or a model folder")
    tune.add_argument("--latency-budget-ms", type=float, help="p99 latency budget (required, but for --int8)")
    tune.add_argument("--model-repository", type=Path, default=Path("models"))
    tune.add_argument("--out-dir", type=Path, help="results.jsonl and config.pbtxt (default tune-<model>)")
    tune.add_argument("--output", type=Path, help="the winning config.pbtxt (default <out-dir>/config.pbtxt)")
    tune.add_argument(
        "--max-seconds", type=float, default=300.0, help="whole search's time limit (default 300)"
    )
    tune.add_argument("-i", "--protocol", choices=PROTOCOL_NAMES, default="grpc", help="default grpc")
    tune.add_argument(
        "--concurrency", type=parse_levels, default=[1, 2, 4, 8], help="sweep (default 1,2,4,8)"
    )
    tune.add_argument("--backends", help="comma list (default: every one whose runtime is installed)")
    tune.add_argument("--precisions", help="comma list: fp32,bf16,fp16 (default fp32 + what the CPU runs)")
    tune.add_argument("--max-candidates", type=int, default=0, help="measure at most this many (0 = all)")
    tune.add_argument(
        "--accuracy-tolerance",
        type=float,
        default=0.02,
        help="lower precisions: max error / output range vs fp32 (default 0.02)",
    )
    tune.add_argument("--fresh", action="store_true", help="ignore earlier results in --out-dir")
    tune.add_argument(
        "--int8-model",
        type=Path,
        metavar="FILE.onnx",
        help="a quantized ONNX made elsewhere (e.g. onnxruntime.quantization): one more candidate per "
        "backend, accepted only past the accuracy check",
    )
    _int8_flags(tune)
    _common(tune)
    tune.set_defaults(func=tune_command)


def _int8_flags(tune: argparse.ArgumentParser) -> None:
    group = tune.add_argument_group(
        "INT8 by calibration (--int8)",
        "Quantize model.onnx here (ONNX Runtime static QDQ; OpenVINO NNCF where installed), keep what passes "
        "the accuracy guard on held-out samples, race it against fp32.",
    )
    group.add_argument("--int8", action="store_true", help="calibrate INT8 candidates and race them")
    group.add_argument("--calibration", type=Path, metavar="DIR", help=".npy / .npz / image samples")
    group.add_argument("--calibration-source", choices=("auto", "folder", "bundle", "warmup"), default="auto",
                       help="auto (default): --calibration DIR, else the model's calibration/ folder (as a "
                       "bundle ships it), else its model_warmup inputs")  # fmt: skip
    group.add_argument("--calibration-samples", type=int, default=256, help="rows at most (default 256)")
    group.add_argument(
        "--calibration-batch", type=int, default=8, help="rows per calibration run (default 8)"
    )
    group.add_argument("--calibration-method", choices=("minmax", "entropy", "percentile"), default="minmax",
                       help="activation ranges (ONNX Runtime; default minmax)")  # fmt: skip
    group.add_argument("--holdout", type=float, default=0.25,
                       help="share of the samples held out for the guard (default 0.25)")  # fmt: skip
    group.add_argument("--int8-min-top1", type=float, default=0.99,
                       help="classifiers: least top-1 agreement with fp32 (default 0.99)")  # fmt: skip
    group.add_argument("--int8-max-error", type=float, default=0.05,
                       help="most RMS error vs fp32, share of an output's range (default 0.05)")  # fmt: skip
    group.add_argument("--int8-engines", default="onnxruntime,nncf",
                       help="quantizers (default onnxruntime,nncf: nncf where installed)")  # fmt: skip
    group.add_argument("--work-dir", type=Path, help="in-progress files (default <cache dir>/int8/)")
    group.add_argument("--apply", action="store_true",
                       help="write the winner (model file + config.pbtxt) into the model folder")  # fmt: skip


def _progress(quiet: bool) -> Any:
    def say(message: str) -> None:
        if not quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return say


def _settings(args: argparse.Namespace, warmup: float, window: float, windows: int) -> Any:
    from edgeserve.bench.load import Settings

    return Settings(
        warmup_s=warmup if args.warmup_s is None else args.warmup_s,
        window_s=window if args.window_s is None else args.window_s,
        stability_pct=args.stability_pct,
        max_windows=windows if args.max_windows is None else args.max_windows,
        timeout_s=args.timeout_s,
    )


def bench_command(args: argparse.Namespace) -> int:
    import asyncio

    from edgeserve.bench.errors import BenchError
    from edgeserve.bench.inputs import parse_shape_flags
    from edgeserve.bench.load import BenchConfig, run_bench
    from edgeserve.bench.report import table, write_csv, write_json

    say = _progress(args.quiet)
    try:
        if args.plot is not None:
            from edgeserve.bench.plot import PLOT_HINT

            try:
                import matplotlib  # noqa: F401  (checked before the run, not after it)
            except ImportError:
                raise BenchError(f"--plot needs matplotlib: {PLOT_HINT}") from None
        if args.url and len(args.protocol) > 1:
            raise BenchError("-u/--url names one protocol's address: use --http-url, --grpc-url, --zmq-url")
        stats = args.stats_url or args.http_url
        deadline = time.monotonic() + args.max_seconds
        points: list[Any] = []
        info: Any = None
        for protocol in args.protocol:
            left = deadline - time.monotonic()
            if left <= 0:
                say(f"time limit ({args.max_seconds:g} s) reached: {protocol} not run")
                continue
            config = BenchConfig(
                model=args.model,
                protocol=protocol,
                url=_address(args, protocol),
                stats_url=None if stats.lower() == "none" else stats,
                version=args.model_version,
                batch_size=args.batch_size,
                shapes=parse_shape_flags(args.shape),
                input_data=args.input_data or ["random"],
                concurrency=args.concurrency or ([] if args.request_rate else [1]),
                request_rates=args.request_rate or [],
                settings=_settings(args, 1.0, 2.0, 10),
                max_seconds=left,
                headers=parse_headers(args.header),
            )
            run = asyncio.run(run_bench(config, say))
            points += run.points
            info = info or run.info
        print(table(points))
        if args.csv:
            write_csv(args.csv, points)
        if args.json:
            extra = {
                "protocols": args.protocol,
                "input_data": args.input_data or ["random"],
                "window_s": config.settings.window_s,
                "stability_pct": args.stability_pct,
            }
            write_json(args.json, points, info, extra)
        if args.plot:
            from edgeserve.bench.plot import plot

            plot(args.plot, points, f"{info.name}: latency against throughput")
    except BenchError as exc:
        print(f"edgeserve bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1 if points and all(p.requests == 0 for p in points) else 0


def tune_command(args: argparse.Namespace) -> int:
    from edgeserve.bench.errors import BenchError
    from edgeserve.bench.tune import TuneOptions, tune

    say = _progress(args.quiet)
    try:
        options = TuneOptions.from_args(args, _settings(args, 0.5, 1.0, 4))
        return tune(options, say)
    except BenchError as exc:
        print(f"edgeserve tune: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
