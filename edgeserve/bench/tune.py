"""`edgeserve tune MODEL --latency-budget-ms X`: the device's Model Analyzer.

Starts `edgeserve serve` on loopback (tune_server.py), walks the candidates (candidates.py), loads each
through the repository API, checks its outputs against an fp32 reference (tune_check.py), measures a
short concurrency sweep with the bench engine and appends the result to `<out-dir>/results.jsonl` at
once. `--int8-model` adds a quantized ONNX made elsewhere as one more candidate per backend, sent with
the load request (its `file:` parameters) and held to the same accuracy check. `--int8` calibrates INT8
candidates here first and races those that pass the accuracy guard (tune_int8.py). A rerun skips
candidates already there (same model bytes, device, protocol and sweep); `--fresh` starts over.
Bounded by `--max-seconds` and `--max-candidates`. Prints the candidates, the throughput / p99
frontier and the best config within the budget, written as config.pbtxt.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeserve.bench.candidates import (
    Candidate,
    apply,
    available_backends,
    cpu_precisions,
    search,
)
from edgeserve.bench.errors import BenchError, RequestError
from edgeserve.bench.inputs import ModelInfo, parse_shape_flags
from edgeserve.bench.load import BenchConfig, Settings, run_bench
from edgeserve.bench.options import from_args
from edgeserve.bench.stats import Point
from edgeserve.bench.tune_check import Reference, compare, outputs
from edgeserve.bench.tune_int8 import (
    ExtraModel,
    Int8Options,
    Int8Rejected,
    calibrate,
    finish,
    given_model,
)
from edgeserve.bench.tune_report import (
    append_record,
    device_fingerprint,
    model_sha256,
    points_of,
    read_records,
    render,
    score,
    write_config,
)
from edgeserve.bench.tune_server import TuneServer, resolve_model

Progress = Callable[[str], None]
MIN_CANDIDATE_S = 5.0  # a candidate is not started with less time than this left


@dataclass
class TuneOptions:
    model: str
    budget_ms: float
    repository: Path = Path("models")
    out_dir: Path | None = None
    output: Path | None = None
    max_seconds: float = 300.0
    protocol: str = "grpc"
    concurrency: Sequence[int] = (1, 2, 4, 8)
    backends: Sequence[str] | None = None
    precisions: Sequence[str] | None = None
    max_candidates: int = 0
    tolerance: float = 0.02
    fresh: bool = False
    int8_model: Path | None = None  # a quantized ONNX made elsewhere: one more candidate per backend
    int8: Int8Options | None = None  # calibrate INT8 candidates here (--int8)
    batch_size: int = 1
    shapes: Sequence[str] = ()
    input_data: Sequence[str] = ("random",)
    settings: Settings = field(default_factory=lambda: Settings(warmup_s=0.5, window_s=1.0, max_windows=4))

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Settings) -> TuneOptions:
        def names(text: str | None) -> list[str] | None:
            return [p.strip() for p in text.split(",") if p.strip()] if text else None

        from edgeserve.bench.tune_int8 import int8_options

        int8 = int8_options(args)
        budget = args.latency_budget_ms
        if budget is None and int8 is None:
            raise BenchError("--latency-budget-ms is required (with --int8 it defaults to no limit)")
        if budget is not None and not budget > 0:
            raise BenchError("--latency-budget-ms must be above 0")
        return from_args(
            cls,
            args,
            budget_ms=math.inf if budget is None else budget,
            repository=args.model_repository,
            backends=names(args.backends),
            precisions=names(args.precisions),
            tolerance=args.accuracy_tolerance,
            int8=int8,
            shapes=args.shape,
            input_data=args.input_data or ["random"],
            settings=settings,
        )


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


async def _model_info(server: TuneServer, name: str) -> ModelInfo:
    from edgeserve.bench.api import HttpApi

    api = HttpApi(server.url("http"))
    try:
        return await api.model_info(name, "")
    finally:
        await api.close()


def _measure(
    server: TuneServer,
    base: Any,
    candidate: Candidate,
    options: TuneOptions,
    reference: Reference,
    deadline: float,
    say: Progress,
    files: dict[str, bytes] | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """Load, check and measure one candidate: its record (status ok | failed | rejected); `files`:
    the artifact to serve it from instead of the model's own (an INT8 candidate); `note`: the INT8
    guard's verdict on held-out rows, which stands instead of the check on random inputs."""
    from google.protobuf import json_format

    config = apply(base, candidate)
    record: dict[str, Any] = {"label": candidate.label, "candidate": asdict(candidate), "points": []}
    started = time.monotonic()
    try:
        server.load(json_format.MessageToJson(config, preserving_proto_field_name=True), files)
    except BenchError as exc:
        seconds = round(time.monotonic() - started, 3)
        return {**record, "status": "failed", "error": f"load: {exc}", "seconds": seconds}
    record["load_s"] = round(time.monotonic() - started, 3)

    async def run() -> dict[str, Any]:
        info = await _model_info(server, base.name)
        got = await outputs(
            server.url("http"),
            info,
            options.shapes,
            options.input_data,
            options.settings.seed + 1,
            options.settings.timeout_s,
        )
        if reference.outputs is None and candidate.precision == "fp32" and not candidate.model:
            reference.save(got)
            accuracy: dict[str, Any] = {"note": "the fp32 reference"}
        elif note is not None:
            accuracy = {"note": note}
        elif reference.outputs is None:
            accuracy = {"note": "no fp32 reference: not checked"}
        else:
            accuracy = compare(reference.outputs, got)
            if accuracy["max_err_over_range"] > options.tolerance:
                say(
                    f"{candidate.label}: rejected: error {accuracy['max_err_over_range']:.3g} "
                    "of the output's scale "
                    f"> {options.tolerance:g} (cosine {accuracy['cosine_min']:.5f})"
                )
                return {"status": "rejected", "accuracy": accuracy, "error": "accuracy"}
        bench = BenchConfig(
            model=base.name,
            protocol=options.protocol,
            url=server.url(options.protocol),
            stats_url=server.http,
            batch_size=options.batch_size,
            shapes=parse_shape_flags(options.shapes),
            input_data=list(options.input_data),
            concurrency=list(options.concurrency),
            settings=options.settings,
            max_seconds=max(1.0, deadline - time.monotonic()),
        )

        def past_budget(points: list[Point]) -> bool:
            last = points[-1]
            best = max(p.throughput for p in points[:-1]) if len(points) > 1 else 0.0
            return last.p99_ms > 2 * options.budget_ms or (
                last.p99_ms > options.budget_ms and last.throughput < 1.05 * best
            )

        result = await run_bench(bench, lambda m: say(f"  {m}"), past_budget)
        return {"status": "ok", "accuracy": accuracy, "points": [p.row() for p in result.points]}

    try:
        record.update(asyncio.run(run()))
    except (BenchError, RequestError) as exc:
        record.update({"status": "failed", "error": str(exc)})
    record["seconds"] = round(time.monotonic() - started, 3)
    return record


def tune(options: TuneOptions, say: Progress) -> int:
    model_dir = resolve_model(options.model, options.repository)
    name = model_dir.name
    out_dir = options.out_dir or Path(f"tune-{name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    if options.fresh:
        results.unlink(missing_ok=True)
        for old in out_dir.glob("reference-*.npz"):
            old.unlink()
    context = {
        "model_sha256": model_sha256(model_dir),
        "device": device_fingerprint(),
        "protocol": options.protocol,
        "concurrency": list(options.concurrency),
        "batch_size": options.batch_size,
        "shapes": list(options.shapes),
        "input_data": list(options.input_data),
        "window_s": options.settings.window_s,
    }
    context_id = hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()[:12]
    reference = Reference(out_dir / f"reference-{context_id}.npz")
    records = read_records(results)
    deadline = time.monotonic() + options.max_seconds
    version_dir = max(
        (p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )
    backends = list(options.backends or available_backends(version_dir))
    # int8 is not a runtime setting: the INT8 candidates are models (--precisions int8: only those race)
    precisions = [p for p in options.precisions or cpu_precisions() if p != "int8"]
    extras: dict[str, ExtraModel] = {}
    if options.int8_model is not None:
        given = given_model(options.int8_model, version_dir.name)
        extras[given.tag] = given
    if options.int8 is not None:
        try:
            extras.update((e.tag, e) for e in calibrate(options.int8, model_dir, version_dir, out_dir,
                                                        options.fresh, say))  # fmt: skip
        except Int8Rejected as exc:
            print(f"edgeserve tune: {exc}")
            return 1

    def files(candidate: Candidate) -> dict[str, bytes] | None:
        return extras[candidate.model].payload(model_dir) if candidate.model else None

    if not backends:
        raise BenchError(
            f"no backend to try for {model_dir}: install onnxruntime or openvino, or pass --backends"
        )
    say(
        f"tune {name}: backends {', '.join(backends)}; precisions {', '.join(precisions) or 'INT8 only'}; "
        f"p99 budget {options.budget_ms:g} ms; results in {results}"
    )
    server = TuneServer(model_dir, name)
    if threading.current_thread() is threading.main_thread():  # SIGTERM: stop our server on the way out
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    measured = skipped = 0
    stopped = ""
    base: Any = None
    try:
        server.start()
        from google.protobuf import json_format
        from tritonclient.grpc import model_config_pb2 as mc

        try:
            server.load(None)
        except BenchError as exc:
            raise BenchError(f"model '{name}' does not load as configured: {exc}") from None
        base = _base_config(
            model_dir, json_format.ParseDict(server.config(), mc.ModelConfig(), ignore_unknown_fields=True)
        )
        rank = lambda c: score(records.get(c.key(context)), options.budget_ms)  # noqa: E731
        for candidate in search(backends, precisions, base.max_batch_size, rank, extra_models=list(extras)):
            extra = extras.get(candidate.model)
            if extra is not None and extra.backends and candidate.backend not in extra.backends:
                continue  # an OpenVINO IR: not an ONNX Runtime candidate
            key = candidate.key(context)
            if key in records:
                skipped += 1
                say(f"{candidate.label}: measured before ({records[key].get('status')}), skipped")
                continue
            if options.max_candidates and measured >= options.max_candidates:
                stopped = f"--max-candidates {options.max_candidates} reached"
                break
            if deadline - time.monotonic() < MIN_CANDIDATE_S:
                stopped = f"--max-seconds {options.max_seconds:g} reached"
                break
            if not server.alive():  # the last candidate took the server down: a fresh one for the next
                say(f"the tune server exited; starting it again:\n{server.log_tail(5)}")
                server.stop(remove=False)
                server.start()
            say(f"candidate {measured + skipped + 1}: {candidate.label}")
            record = {
                "key": key,
                **_measure(
                    server,
                    base,
                    candidate,
                    options,
                    reference,
                    deadline,
                    say,
                    files(candidate),
                    extra.note if extra is not None else None,
                ),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            if time.monotonic() >= deadline - options.settings.window_s:  # its sweep was cut short
                stopped = f"--max-seconds {options.max_seconds:g} reached"
                say(f"{candidate.label}: cut by the time limit; not recorded (measured again next run)")
                break
            append_record(results, record)
            records[key] = record
            measured += 1
            found = score(record, options.budget_ms)
            say(
                f"{candidate.label}: {record['status']}"
                + (f", best within budget {found:.1f} infer/s" if found else "")
                + f" ({record['seconds']:.1f} s)"
            )
    finally:
        server.stop()
    text, best = render(_in_context(records, context), options.budget_ms)
    print(text)
    print(
        f"\n{measured} candidate(s) measured now, {skipped} from earlier runs"
        + (f"; stopped: {stopped} (run again to continue)" if stopped else "; search complete")
    )
    if best is None:
        print(f"no measured config keeps p99 within {options.budget_ms:g} ms: no config.pbtxt written")
        return 1
    winner = Candidate(**records[best.key]["candidate"])
    config = apply(base, winner)
    output = options.output or out_dir / "config.pbtxt"
    write_config(output, config, best, options.budget_ms, options.protocol)
    finish(extras.get(winner.model), list(extras), options.int8, output, model_dir, version_dir, out_dir, say,
           best.label, {r["candidate"].get("model", "") for r in records.values()})  # fmt: skip
    print(
        f"best within {options.budget_ms:g} ms: {best.label} at concurrency {best.concurrency}: "
        f"{best.throughput:.1f} infer/s, p99 {best.p99_ms:.2f} ms -> {output}"
    )
    return 0


# parameters the server adds to show its choices, not settings
SERVER_NOTES = ("runtime_choice", "runtime_choice_final")


def _base_config(model_dir: Path, served: Any) -> Any:
    """What candidates rewrite: the model's own config.pbtxt (so the written config differs from it only
    in what was tuned), else the server's auto-completed config less its notes; the batch size the
    server serves with either way."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    path = model_dir / "config.pbtxt"
    if path.is_file():
        base = mc.ModelConfig()
        try:
            text_format.Parse(path.read_text(), base)
        except text_format.ParseError:
            base.CopyFrom(served)
    else:
        base = served
    for key in SERVER_NOTES:
        if key in base.parameters:
            del base.parameters[key]
    base.name = served.name
    base.max_batch_size = served.max_batch_size
    return base


def _in_context(records: dict[str, dict[str, Any]], context: dict[str, Any]) -> list[dict[str, Any]]:
    """The records measured with this model, device and sweep (others in the file are left out)."""
    found = []
    for record in records.values():
        try:
            candidate = Candidate(**record["candidate"])
        except (KeyError, TypeError):
            continue
        if candidate.key(context) == record.get("key"):
            found.append(record)
    return found


__all__ = ["TuneOptions", "compare", "points_of", "tune"]
