"""Soak test of the appliance: `edgeserve run` under steady mixed load for N minutes, with the server
child SIGKILLed at half time, watching memory, file descriptors and threads of both processes.

    python benchmarks/soak.py --minutes 10                   # mlp; 4 paced clients
    python benchmarks/soak.py --minutes 10 --with-cls        # + ppocr_cls over gRPC at a low rate

Load (threads in this process, each paced to `--rate` requests/s, bounded by count and time, loopback
only): HTTP (KServe V2 JSON, requests.Session), gRPC unary and gRPC streaming (tritonclient.grpc),
ZeroMQ (edgeserve.client.ZmqClient, numpy inputs inline). A client that fails keeps its connection
and tries again; after 3 failures in a row it builds a new client (counted as `reconnects`), as an
application would.

At half time the server child (not the supervisor) gets SIGKILL. The restart window runs from the
kill until every protocol has succeeded again; errors inside it are counted apart from the others.
The script times: kill -> new child pid, -> /v2/health/ready 200, -> STATUS "serving" on the notify
socket (this script stands in for systemd: NOTIFY_SOCKET, WATCHDOG_USEC), -> first success per
protocol, and any gap in WATCHDOG=1 pings.

Every `--sample` seconds: RSS, open fds and threads of the supervisor and of the server, request and
error counts per protocol; one progress line each. At the end: a table, and the verdict "flat after
warm-up" per process and measure: mean of the last 3 samples vs the mean of the first 3 after warm-up
(the first `--warmup` seconds, and for the server again `--warmup` seconds after its restart), and the
slope of a linear fit (per minute) over the samples after warm-up. JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import shutil
import signal
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from bench_appliance import RESULTS, Appliance, code_version, fds_threads, start_appliance, temp_repository
from common import bench_parser, machine_facts, progress

MB = 1024 * 1024
# growth beyond these, last 3 samples vs first 3 after warm-up, counts as "grew"
GROWTH_LIMITS = {"rss_mb": 5.0, "fds": 2, "threads": 2}


# -- clients --------------------------------------------------------------------------------------------
@dataclass
class Counter:
    ok: int = 0
    errors_window: int = 0  # during the restart window
    errors_other: int = 0  # any other time: each one is a finding
    reconnects: int = 0
    first_other_errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    first_ok_after_kill: float | None = None


class Clock:
    """Shared state of the run: when the kill happened and whether the restart window is open."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.kill_at: float | None = None
        self.window_open = False
        self.lock = threading.Lock()


def paced(rate: float, deadline: float, max_requests: int) -> Callable[[], bool]:
    """A pacer: call it before each request; it sleeps to keep `rate`/s (no bursts after a stall)
    and returns False when the time or count budget is spent."""
    interval = 1.0 / rate
    state = {"next": time.monotonic(), "n": 0}

    def wait() -> bool:
        now = time.monotonic()
        if now >= deadline or state["n"] >= max_requests:
            return False
        if state["next"] > now:
            time.sleep(state["next"] - now)
        state["next"] = max(state["next"] + interval, time.monotonic())
        state["n"] += 1
        return True

    return wait


def client_loop(
    name: str,
    make: Callable[[], Any],
    call: Callable[[Any], None],
    close: Callable[[Any], None],
    counter: Counter,
    clock: Clock,
    rate: float,
    deadline: float,
    max_requests: int,
) -> None:
    pace = paced(rate, deadline, max_requests)
    client: Any = None
    failures = 0
    while pace():
        try:
            if client is None:
                client = make()
            t0 = time.monotonic()
            call(client)
            dt = time.monotonic() - t0
        except Exception as exc:
            failures += 1
            with clock.lock:
                if clock.window_open:
                    counter.errors_window += 1
                else:
                    counter.errors_other += 1
                    if len(counter.first_other_errors) < 5:
                        at = time.monotonic() - clock.t0
                        counter.first_other_errors.append(
                            f"t={at:.1f}s {type(exc).__name__}: {str(exc)[:200]}"
                        )
            if failures >= 3 and client is not None:
                with contextlib.suppress(Exception):
                    close(client)
                client = None
                counter.reconnects += 1
                failures = 0
            time.sleep(0.05)
            continue
        failures = 0
        counter.ok += 1
        if len(counter.latencies) < 200_000:
            counter.latencies.append(dt)
        if (
            clock.kill_at is not None
            and counter.first_ok_after_kill is None
            and time.monotonic() > clock.kill_at
        ):
            counter.first_ok_after_kill = time.monotonic() - clock.kill_at
    if client is not None:
        with contextlib.suppress(Exception):
            close(client)


def make_clients(
    app: Appliance, with_cls: bool
) -> dict[str, tuple[Callable[[], Any], Callable[[Any], None], Callable[[Any], None], float]]:
    """name -> (make, call, close, rate factor)."""
    import requests
    import tritonclient.grpc as grpcclient

    from edgeserve.client import ZmqClient

    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}
    url = f"http://127.0.0.1:{app.http_port}/v2/models/mlp/infer"
    grpc_url = f"127.0.0.1:{app.grpc_port}"

    def grpc_input(name: str, array: np.ndarray) -> Any:
        tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        return tensor

    def http_call(session: Any) -> None:
        response = session.post(url, json=body, timeout=5)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        if len(response.json()["outputs"][0]["data"]) != 4:
            raise RuntimeError("bad output")

    def grpc_call(client: Any) -> None:
        out = client.infer("mlp", [grpc_input("INPUT0", x)], client_timeout=5).as_numpy("OUTPUT0")
        if out.shape != (1, 4):
            raise RuntimeError(f"bad output {out.shape}")

    class Stream:
        def __init__(self) -> None:
            self.client = grpcclient.InferenceServerClient(grpc_url)
            self.replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
            self.client.start_stream(callback=lambda result, error: self.replies.put((result, error)))

        def call(self) -> None:
            self.client.async_stream_infer("mlp", [grpc_input("INPUT0", x)])
            result, error = self.replies.get(timeout=5)
            if error is not None:
                raise RuntimeError(f"stream: {error}")
            if result.as_numpy("OUTPUT0").shape != (1, 4):
                raise RuntimeError("bad output")

        def close(self) -> None:
            with contextlib.suppress(Exception):
                self.client.stop_stream()
            self.client.close()

    def zmq_call(client: Any) -> None:
        out = client.infer("mlp", {"INPUT0": x}).as_numpy("OUTPUT0")
        if out.shape != (1, 4):
            raise RuntimeError(f"bad output {out.shape}")

    clients: dict[str, Any] = {
        "http": (lambda: requests.Session(), http_call, lambda s: s.close(), 1.0),
        "grpc": (lambda: grpcclient.InferenceServerClient(grpc_url), grpc_call, lambda c: c.close(), 1.0),
        "grpc_stream": (Stream, lambda s: s.call(), lambda s: s.close(), 1.0),
        "zmq": (lambda: ZmqClient(app.zmq_endpoint, timeout=2.0), zmq_call, lambda c: c.close(), 1.0),
    }
    if with_cls:
        image = np.random.default_rng(1).random((1, 3, 48, 192), dtype=np.float32)

        def cls_call(client: Any) -> None:
            client.infer("ppocr_cls", [grpc_input("x", image)], client_timeout=10)

        clients["grpc_cls"] = (
            lambda: grpcclient.InferenceServerClient(grpc_url),
            cls_call,
            lambda c: c.close(),
            0.2,
        )
    return clients


# -- sampling -------------------------------------------------------------------------------------------
def process_sample(pid: int | None) -> dict[str, Any]:
    if pid is None:
        return {"pid": None}
    try:
        rss = psutil.Process(pid).memory_info().rss / MB
        fds, threads = fds_threads(pid)
    except (psutil.Error, OSError):
        return {"pid": pid}
    return {"pid": pid, "rss_mb": rss, "fds": fds, "threads": threads}


def thread_census(pid: int) -> dict[str, int]:
    """How many threads of `pid` carry each name (/proc/<pid>/task/*/comm)."""
    names: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
                names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def ready(app: Appliance) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{app.http_port}/v2/health/ready", timeout=1) as r:
            return bool(r.status == 200)
    except Exception:
        return False


def linear_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t seconds, value) points, per minute; nan with fewer than 3 points."""
    if len(points) < 3:
        return float("nan")
    ts, vs = [p[0] for p in points], [p[1] for p in points]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return 60.0 * sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den if den else float("nan")


def judge(
    samples: list[dict[str, Any]], proc: str, start_s: float, end_s: float = float("inf")
) -> dict[str, Any]:
    """Flat after warm-up? For `proc` ("supervisor"/"server"), samples with start_s <= t < end_s."""
    window = [s for s in samples if start_s <= s["t"] < end_s and "rss_mb" in s[proc]]
    out: dict[str, Any] = {"from_s": start_s, "to_s": min(end_s, samples[-1]["t"]), "n": len(window)}
    if len(window) < 6:
        out["verdict"] = "too few samples"
        return out
    grew = []
    for key, limit in GROWTH_LIMITS.items():
        first = statistics.fmean(s[proc][key] for s in window[:3])
        last = statistics.fmean(s[proc][key] for s in window[-3:])
        slope = linear_slope([(s["t"], s[proc][key]) for s in window])
        out[key] = {
            "first3": first,
            "last3": last,
            "delta": last - first,
            "slope_per_min": slope,
            "min": min(s[proc][key] for s in window),
            "max": max(s[proc][key] for s in window),
        }
        if last - first > limit:
            grew.append(f"{key} +{last - first:.1f}")
    out["verdict"] = "flat" if not grew else "GREW: " + ", ".join(grew)
    return out


# -- the run --------------------------------------------------------------------------------------------
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s per client (default 50)")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of warm-up (default 60)")
    parser.add_argument("--with-cls", action="store_true", help="add ppocr_cls over gRPC at rate/5")
    parser.add_argument("--no-kill", action="store_true", help="do not kill the server at half time")
    args = parser.parse_args()
    duration = args.minutes * 60
    models = ["mlp", *(["ppocr_cls"] if args.with_cls else [])]
    progress(f"{machine_facts()}; edgeserve at {code_version()}")
    with temp_repository(models) as repo:
        app = start_appliance(repo, models, env={"WATCHDOG_USEC": "10000000"})  # pings every 5 s
        try:
            ready_s = app.wait_ready(300)
            progress(f"READY=1 after {ready_s:.2f}s; supervisor pid {app.pid}, server pid {app.server_pid()}")
            result = soak(app, models, args, duration)
            result["ready_s"] = ready_s
        finally:
            code, stop_s = app.stop()
            log_tail = app.log()[-6000:]
            shutil.rmtree(app.tmp, ignore_errors=True)
    result["sigterm"] = {"exit_code": code, "seconds": stop_s}
    result["log_tail"] = log_tail
    progress(f"SIGTERM -> supervisor exit {code} in {stop_s:.2f}s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2, default=str))
    progress(f"wrote {out}")
    report(result)


def soak(app: Appliance, models: list[str], args: argparse.Namespace, duration: float) -> dict[str, Any]:
    clock = Clock()
    deadline = clock.t0 + duration
    specs = make_clients(app, "ppocr_cls" in models)
    counters = {name: Counter() for name in specs}
    threads = [
        threading.Thread(
            target=client_loop,
            name=name,
            daemon=True,
            args=(
                name,
                make,
                call,
                close,
                counters[name],
                clock,
                args.rate * factor,
                deadline,
                int(args.rate * factor * duration * 1.1) + 10,
            ),
        )
        for name, (make, call, close, factor) in specs.items()
    ]
    for t in threads:
        t.start()
    kill_at_s = None if args.no_kill else duration / 2
    restart: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    next_sample = clock.t0 + 1.0
    killed_pid: int | None = None
    thread_names: dict[str, dict[str, int]] = {}
    while time.monotonic() < deadline:
        now = time.monotonic()
        if kill_at_s is not None and killed_pid is None and now - clock.t0 >= kill_at_s:
            killed_pid = app.server_pid()
            restart = kill_and_watch(app, clock, counters, killed_pid)
        if now >= next_sample:
            sample: dict[str, Any] = {
                "t": now - clock.t0,
                "supervisor": process_sample(app.pid),
                "server": process_sample(app.server_pid()),
                "requests": {
                    n: {"ok": c.ok, "err_window": c.errors_window, "err_other": c.errors_other}
                    for n, c in counters.items()
                },
            }
            samples.append(sample)
            server_pid = sample["server"].get("pid")
            if server_pid is not None and "threads" in sample["server"]:
                thread_names[str(server_pid)] = thread_census(server_pid)  # the latest census per server
            sup, srv = sample["supervisor"], sample["server"]
            reqs = " ".join(f"{n}={c.ok}/{c.errors_window}/{c.errors_other}" for n, c in counters.items())
            progress(
                f"t={sample['t']:5.0f}s sup rss {sup.get('rss_mb', 0):5.1f} MB fds {sup.get('fds')} thr "
                f"{sup.get('threads')} | srv pid {srv.get('pid')} rss {srv.get('rss_mb', 0):6.1f} MB fds "
                f"{srv.get('fds')} thr {srv.get('threads')} | ok/err_win/err_other {reqs}"
            )
            next_sample += args.sample
        time.sleep(min(0.2, max(0.0, next_sample - time.monotonic())))
    for t in threads:
        t.join(30)
    if restart:  # the supervisor's STATUS "serving" after the kill (it may come after the clients recover)
        kill_mono = clock.t0 + restart["at_s"]
        restart["status_serving_s"] = next(
            (
                at - kill_mono
                for at, f in app.notify.messages
                if at >= kill_mono and f.get("STATUS", "").startswith("serving")
            ),
            None,
        )
    kill_t = kill_at_s if kill_at_s is not None else float("inf")
    rewarm_from = (restart.get("all_protocols_ok_s") or 0.0) + kill_t + args.warmup
    analysis = {
        "supervisor": judge(samples, "supervisor", args.warmup),
        "server_before_kill": judge(samples, "server", args.warmup, kill_t),
        "server_after_restart": judge(samples, "server", rewarm_from) if kill_at_s is not None else {},
    }
    wd = [at - clock.t0 for at, f in app.notify.messages if f.get("WATCHDOG") == "1" and at >= clock.t0]
    gaps = [b - a for a, b in itertools.pairwise(wd)]
    statuses = [
        (round(at - clock.t0, 2), f["STATUS"])
        for at, f in app.notify.messages
        if "STATUS" in f and at >= clock.t0
    ]
    return {
        "code": code_version(),
        "args": vars(args),
        "models": models,
        "duration_s": duration,
        "machine": machine_facts(),
        "samples": samples,
        "restart": restart,
        "analysis": analysis,
        "watchdog": {"pings": len(wd), "max_gap_s": max(gaps) if gaps else None},
        "status_messages": statuses,
        "server_thread_names": thread_names,
        "protocols": {
            n: {
                "ok": c.ok,
                "errors_window": c.errors_window,
                "errors_other": c.errors_other,
                "reconnects": c.reconnects,
                "first_other_errors": c.first_other_errors,
                "first_ok_after_kill_s": c.first_ok_after_kill,
                "p50_ms": 1e3 * statistics.median(c.latencies) if c.latencies else None,
                "p99_ms": 1e3 * sorted(c.latencies)[int(0.99 * (len(c.latencies) - 1))]
                if c.latencies
                else None,
            }
            for n, c in counters.items()
        },
    }


def kill_and_watch(
    app: Appliance, clock: Clock, counters: dict[str, Counter], pid: int | None
) -> dict[str, Any]:
    """SIGKILL the server child; wait for the new child, ready, and a success on every protocol."""
    assert pid is not None, "no server child to kill"
    with clock.lock:
        clock.window_open = True
        kill_at = time.monotonic()
        clock.kill_at = kill_at
    os.kill(pid, signal.SIGKILL)
    progress(f"SIGKILL server pid {pid} at t={kill_at - clock.t0:.1f}s (supervisor pid {app.pid} kept)")
    out: dict[str, Any] = {"killed_pid": pid, "at_s": kill_at - clock.t0}
    limit = kill_at + 120
    while time.monotonic() < limit:
        child = app.server_pid()
        if child is not None and child != pid and "new_pid_s" not in out:
            out["new_pid"], out["new_pid_s"] = child, time.monotonic() - kill_at
        if "new_pid_s" in out and "ready_s" not in out and ready(app):
            out["ready_s"] = time.monotonic() - kill_at
        if "ready_s" in out and all(c.first_ok_after_kill is not None for c in counters.values()):
            out["all_protocols_ok_s"] = time.monotonic() - kill_at
            break
        time.sleep(0.05)
    with clock.lock:
        clock.window_open = False
    out["window_s"] = time.monotonic() - kill_at
    out["first_ok_s"] = {n: c.first_ok_after_kill for n, c in counters.items()}
    progress(
        f"restart: new pid {out.get('new_pid')} after {out.get('new_pid_s', float('nan')):.2f}s, ready after "
        f"{out.get('ready_s', float('nan')):.2f}s, all protocols OK after "
        f"{out.get('all_protocols_ok_s', float('nan')):.2f}s; first OK per protocol {out['first_ok_s']}"
    )
    return out


def report(res: dict[str, Any]) -> None:
    print(f"Machine: {res['machine']}; edgeserve at {res.get('code', 'unknown')}")
    print(
        f"Soak {res['duration_s'] / 60:.0f} min, models {', '.join(res['models'])}, "
        f"{res['args']['rate']:.0f} req/s per client; READY=1 after {res['ready_s']:.2f}s\n"
    )
    print(
        "| protocol | ok | errors in restart window | errors outside | reconnects | first OK after kill "
        "| p50 ms | p99 ms |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, p in res["protocols"].items():
        first = p["first_ok_after_kill_s"]
        print(
            f"| {name} | {p['ok']} | {p['errors_window']} | {p['errors_other']} | {p['reconnects']} | "
            f"{'' if first is None else f'{first:.2f} s'} | {p['p50_ms'] or 0:.2f} | {p['p99_ms'] or 0:.2f} |"
        )
    for name, p in res["protocols"].items():
        for line in p["first_other_errors"]:
            print(f"  {name} error outside the window: {line}")
    r = res["restart"]
    if r:
        print(
            f"\nRestart after SIGKILL of pid {r['killed_pid']} at t={r['at_s']:.0f}s: new child after "
            f"{r.get('new_pid_s', float('nan')):.2f}s, /v2/health/ready after "
            f"{r.get('ready_s', float('nan')):.2f}s, "
            f"STATUS serving after {r.get('status_serving_s') or float('nan'):.2f}s, every protocol OK after "
            f"{r.get('all_protocols_ok_s', float('nan')):.2f}s"
        )
    wd = res["watchdog"]
    print(
        f"WATCHDOG=1 pings: {wd['pings']}, longest gap {wd['max_gap_s'] or float('nan'):.1f}s "
        "(WATCHDOG_USEC=10s)"
    )
    census = res.get("server_thread_names", {})
    if len(census) > 1:
        print("Server threads by name, per server pid (last sample of each):")
        for pid, names in census.items():
            print(f"  {pid}: {sum(names.values())} threads: {names}")
    print(f"SIGTERM at the end: exit {res['sigterm']['exit_code']} in {res['sigterm']['seconds']:.2f}s\n")
    print(
        "| process (window) | measure | first 3 after warm-up | last 3 | delta | slope /min | min-max "
        "| verdict |"
    )
    print("|---|---|--:|--:|--:|--:|---|---|")
    for label, a in res["analysis"].items():
        if not a or "rss_mb" not in a:
            if a:
                print(f"| {label} | | | | | | | {a.get('verdict')} |")
            continue
        for key in GROWTH_LIMITS:
            m = a[key]
            print(
                f"| {label} ({a['from_s']:.0f}-{a['to_s']:.0f} s, n={a['n']}) | {key} | {m['first3']:.1f} | "
                f"{m['last3']:.1f} | {m['delta']:+.1f} | {m['slope_per_min']:+.3f} | "
                f"{m['min']:.1f}-{m['max']:.1f} | "
                f"{a['verdict'] if key == 'rss_mb' else ''} |"
            )
    print("\nSamples (t s: supervisor RSS MB/fds/threads | server pid RSS MB/fds/threads):")
    for s in res["samples"]:
        sup, srv = s["supervisor"], s["server"]
        print(
            f"  {s['t']:5.0f}: {sup.get('rss_mb', 0):5.1f}/{sup.get('fds')}/{sup.get('threads')} | "
            f"{srv.get('pid')} {srv.get('rss_mb', 0):6.1f}/{srv.get('fds')}/{srv.get('threads')}"
        )


if __name__ == "__main__":
    main()
