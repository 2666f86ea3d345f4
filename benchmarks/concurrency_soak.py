"""The concurrency suite's long round: many seeded clients against one `edgeserve serve` for minutes,
every answer checked on the client side, new model versions loaded during the traffic.

    python benchmarks/concurrency_soak.py --seed 7 --clients 64 --minutes 10
    python benchmarks/concurrency_soak.py --seed 7 --clients 64 --minutes 60 --reload-every 2000

The clients, models and checks are tests/concurrency/ (workload.py: plans and checkers; conc_models.py:
the models and their references; conc_wires.py: the wires). Client `i` talks over the `i % 8`th wire
(HTTP, gRPC unary, gRPC stream, ZeroMQ inline, ZeroMQ through the shm frame ring, or one of the asyncio
clients shared by many threads: gRPC, HTTP, ZeroMQ) and mixes every model: stateless ones with dynamic
batching (ONNX Runtime, OpenVINO, Python, the response cache, an ensemble of Python steps, a slow
Python model that some calls give up on with a short deadline), sequences (Direct and Oldest, every
control datatype, implicit state, ONNX Runtime and Python), and two models (ONNX Runtime, Python) of
which a new version is loaded every `--reload-every` finished ops. A seed fixes every client's plan;
the same seed replays the same requests (their interleaving is the machine's). Nothing here asserts
on timing.

Progress every `--progress-s` seconds (stderr); at the end a summary (requests, mismatches by kind and
model, the first mismatches in full, the machine) and exit status 1 when any answer was wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import ROOT, machine_facts, progress

sys.path.insert(0, str(ROOT / "tests" / "concurrency"))
from conc_models import RELOADABLE, SLOW, STATELESS, Repository
from conc_seq_models import SEQUENCES
from conc_server import endpoints, start
from workload import (
    Mix,
    Progress,
    Report,
    VersionWindow,
    reload_rounds,
    run_clients,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="fixes every client's plan (replay with it)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs")
    parser.add_argument(
        "--reload-every",
        type=int,
        default=1000,
        help="finished ops between two loads of a new version (0: no reloads)",
    )
    parser.add_argument("--progress-s", type=float, default=15.0, help="seconds between progress lines")
    parser.add_argument(
        "--max-think-ms", type=float, default=5.0, help="longest pause between a client's ops"
    )
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 512 or args.minutes <= 0:
        parser.error("--clients must be 1..512 and --minutes above 0")
    return args


def _printer(
    report: Report, window: VersionWindow, began: float, every_s: float, stop: threading.Event
) -> None:
    last_requests, last_t = 0, began
    while not stop.wait(every_s):
        now = time.monotonic()
        with report.lock:
            requests, summary = report.requests, report.summary()
        rate = (requests - last_requests) / max(now - last_t, 1e-9)
        progress(f"{now - began:7.0f} s  {rate:7.0f} req/s  versions loaded {window.loaded}  {summary}")
        last_requests, last_t = requests, now


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    replay = (
        f"python benchmarks/concurrency_soak.py --seed {args.seed} --clients {args.clients} "
        f"--minutes {args.minutes:g} --reload-every {args.reload_every}"
    )
    with tempfile.TemporaryDirectory(prefix="edgeserve-conc-soak-") as tmp_name:
        tmp = Path(tmp_name)
        stateless = (*STATELESS, *SLOW)
        repo = Repository(tmp / "models", stateless=stateless, sequences=SEQUENCES, reloadable=RELOADABLE)
        progress(f"starting edgeserve with {len(stateless) + len(SEQUENCES) + len(RELOADABLE)} models")
        server = start(repo, tmp)
        try:
            return _soak(args, repo, server, replay)
        finally:
            code = server.stop()
            progress(f"server stopped (exit status {code})")


def _soak(args: argparse.Namespace, repo: Repository, server: Any, replay: str) -> int:
    mix = Mix(
        stateless=(*STATELESS, *SLOW, *RELOADABLE),
        sequences=SEQUENCES,
        p_sequence=0.4,
        p_versioned=0.1,
        p_deadline=0.05,
        max_think_ms=args.max_think_ms,
    )
    stop = threading.Event()
    window = VersionWindow(1)
    done = Progress()
    report = Report(args.seed)
    problems: list[str] = []
    began = time.monotonic()
    timer = threading.Timer(args.minutes * 60, stop.set)
    timer.start()
    printer = threading.Thread(
        target=_printer, args=(report, window, began, args.progress_s, stop), daemon=True
    )
    printer.start()
    controller = None
    if args.reload_every > 0:
        controller = threading.Thread(
            target=lambda: problems.extend(
                reload_rounds(endpoints(server), repo, window, done, stop, None, args.reload_every, progress)
            ),
            daemon=True,
        )
        controller.start()
    progress(f"{args.clients} clients for {args.minutes:g} min, seed {args.seed}")
    try:
        run_clients(
            endpoints(server),
            args.seed,
            args.clients,
            mix,
            run=args.seed % 64,
            stop=stop,
            window=window,
            progress=done,
            report=report,
            join_timeout_s=args.minutes * 60 + 600,
        )
    finally:
        stop.set()
        timer.cancel()
    if controller is not None:
        controller.join(120)
    elapsed = time.monotonic() - began
    alive = server.alive()
    facts = machine_facts()
    print(report.render(replay))
    print(
        f"{report.requests} requests in {elapsed:.0f} s ({report.requests / max(elapsed, 1e-9):.0f}/s); "
        f"{window.loaded - 1} new versions loaded; server {'alive' if alive else 'DEAD'}"
    )
    for problem in problems:
        print(f"reload problem: {problem}")
    print(f"machine: {facts}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "seed": args.seed,
                    "clients": args.clients,
                    "minutes": args.minutes,
                    "elapsed_s": elapsed,
                    "requests": report.requests,
                    "ops": report.ops,
                    "by_transport": dict(report.by_transport),
                    "mismatches": dict(report.by_kind),
                    "by_model": dict(report.by_model),
                    "first": [str(m) for m in report.mismatches],
                    "versions_loaded": window.loaded - 1,
                    "reload_problems": problems,
                    "server_alive": alive,
                    "machine": facts,
                    "replay": replay,
                },
                indent=2,
            )
        )
    return 0 if report.ok and not problems and alive else 1


if __name__ == "__main__":
    sys.exit(main())
