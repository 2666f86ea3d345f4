"""The appliance's own costs: how fast `edgeserve run` says READY=1, how much memory the supervisor and
the server hold (idle and under load), and how much disk `pip install edgeserve[onnxruntime]` takes.

    python benchmarks/bench_appliance.py                    # everything, 5 repetitions of each start
    python benchmarks/bench_appliance.py --skip-install     # without the fresh-venv install (network)

What is measured, and how:

- Start to READY=1: this script binds a datagram socket, starts `python -m edgeserve run` with
  NOTIFY_SOCKET pointing at it (as systemd would) and times spawn -> the READY=1 datagram. Three
  repositories: an empty one (the appliance's own start, no model load; target < 2 s), one holding a
  copy of models/mlp (`--load-model mlp`), and the full sample repository (all four models), for
  context. Each start is stopped with SIGTERM (the supervisor drains and must exit 0).
- Memory: RSS of the supervisor alone (target < 40 MB) and of supervisor + server child (found with
  psutil's children()) idle with only mlp on ONNX Runtime (target < 150 MB), USS/PSS too (shared
  libraries count in every RSS); then under load (4 client threads, 2 HTTP + 2 gRPC, mlp, for
  `--load-seconds`) sampled every 0.5 s: peak and end; and the full sample repository idle, against
  the 417 MB RSS one server process held with the four models before the supervisor existed.
- Installed size: `python -m venv` + `pip install '<repo>[onnxruntime]'` (not editable) in a fresh
  temporary venv; `du -sb` of it minus a fresh venv with only pip; the 10 largest distributions by
  the size of their site-packages folders (target < 400 MB).

Results: a markdown table on stdout, progress on stderr, JSON in benchmarks/results/.
Only processes started here are stopped, by their process id; all traffic is on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from common import ROOT, bench_parser, free_port, machine_facts, progress
from es_server import server_command, terminate
from notify_socket import NotifyListener

RESULTS = ROOT / "benchmarks" / "results"
MODELS = ROOT / "models"
SAMPLE_MODELS = ("mlp", "ppocr_cls", "ppocr_det", "ppocr_rec")
MB = 1024 * 1024

TARGETS = {"ready_empty_s": 2.0, "supervisor_rss_mb": 40.0, "mlp_rss_mb": 150.0, "install_mb": 400.0}
BEFORE_FULL_RSS_MB = 417.0  # one `edgeserve serve` with the four sample models, before the supervisor


# -- the appliance process ------------------------------------------------------------------------------
@dataclass
class Appliance:
    """One `python -m edgeserve run` (the supervisor) on free loopback ports, in its own temp folder."""

    process: subprocess.Popen[bytes]
    tmp: Path
    http_port: int
    grpc_port: int
    zmq_endpoint: str
    log_path: Path
    spawned_at: float
    notify: NotifyListener
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def server_pid(self) -> int | None:
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(self.pid).children()
            if children:
                return int(children[0].pid)
        return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> float:
        try:
            ready = self.notify.wait_for("READY", "1", timeout, since=self.spawned_at)
        except AssertionError:
            raise RuntimeError(
                f"no READY=1 in {timeout:.0f}s (exit code {self.process.poll()}):\n{self.log()[-4000:]}"
            ) from None
        return ready.at - self.spawned_at

    def stop(self, timeout: float = 60.0) -> tuple[int, float]:
        """SIGTERM to the supervisor (this process only); its exit code and how long it took."""
        t0 = time.monotonic()
        code = terminate(self.process, timeout)
        self.notify.close()
        return code, time.monotonic() - t0


def start_appliance(
    repository: Path,
    load_models: list[str],
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Appliance:
    """Spawn `python -m edgeserve run` with NOTIFY_SOCKET bound here; returns at once (no wait)."""
    tmp = Path(tempfile.mkdtemp(prefix="es-appl-"))
    http_port, grpc_port = free_port(), free_port()
    zmq_endpoint = f"ipc://{tmp}/edgeserve.zmq"
    log_path = tmp / "supervisor.log"
    notify = NotifyListener(tmp / "notify.sock")
    models = [a for m in load_models for a in ("--load-model", m)]
    cmd = server_command(
        "run", repository, http_port, grpc_port, zmq_endpoint, [*models, *(extra_args or [])]
    )
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "EDGESERVE_SERVER_STATE_DIR": str(tmp / "state"),
        "NOTIFY_SOCKET": notify.address,
        **(env or {}),
    }
    with open(log_path, "wb") as log_file:
        spawned_at = time.monotonic()
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    return Appliance(process, tmp, http_port, grpc_port, zmq_endpoint, log_path, spawned_at, notify)


@contextlib.contextmanager
def temp_repository(models: list[str]) -> Iterator[Path]:
    """A temporary model repository holding copies of the named sample models (none: empty)."""
    root = Path(tempfile.mkdtemp(prefix="es-repo-"))
    try:
        for model in models:
            shutil.copytree(MODELS / model, root / model)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- process figures ------------------------------------------------------------------------------------
def memory(pid: int) -> dict[str, float]:
    """RSS, USS and PSS in MB (USS/PSS from /proc/<pid>/smaps; absent when psutil cannot read them)."""
    process = psutil.Process(pid)
    out = {"rss_mb": process.memory_info().rss / MB}
    with contextlib.suppress(psutil.Error, AttributeError):
        full = process.memory_full_info()
        out["uss_mb"] = full.uss / MB
        if hasattr(full, "pss"):
            out["pss_mb"] = full.pss / MB
    return out


def fds_threads(pid: int) -> tuple[int, int]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            threads = int(line.split()[1])
    return fds, threads


def imported_heavy(pid: int) -> list[str]:
    """Which of numpy/onnxruntime/openvino/grpc the process has mapped (it must map none)."""
    found = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            for name in ("numpy", "onnxruntime", "openvino", "grpc"):
                if f"/{name}" in line:
                    found.add(name)
    return sorted(found)


def code_version() -> str:
    """The commit measured, and whether edgeserve/ differs from it (others edit it concurrently)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "edgeserve"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}{' + uncommitted changes in edgeserve/' if dirty else ''}"


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s: dict[str, float], unit: str = "", digits: int = 2) -> str:
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f}, n={s['n']})"


# -- a: start to READY=1 --------------------------------------------------------------------------------
def time_ready(label: str, repository: Path, load: list[str], repeats: int, timeout: float) -> dict[str, Any]:
    times, stops = [], []
    status = ""
    for i in range(repeats):
        app = start_appliance(repository, load)
        try:
            ready = app.wait_ready(timeout)
            status = next((f.get("STATUS", "") for _, f in app.notify.messages if f.get("READY") == "1"), "")
        finally:
            code, stop_s = app.stop()
            shutil.rmtree(app.tmp, ignore_errors=True)
        if code != 0:
            raise RuntimeError(f"{label}: supervisor exited {code} on SIGTERM")
        times.append(ready)
        stops.append(stop_s)
        progress(
            f"ready [{label}] {i + 1}/{repeats}: READY=1 after {ready:.3f}s; SIGTERM -> exit 0 in "
            f"{stop_s:.2f}s"
        )
        time.sleep(0.5)
    progress(f"ready [{label}]: STATUS with READY=1: {status}")
    return {"ready_s": summary(times), "stop_s": summary(stops), "raw_ready_s": times, "ready_status": status}


# -- b: memory ------------------------------------------------------------------------------------------
def idle_memory(
    label: str, repository: Path, load: list[str], repeats: int, settle_s: float
) -> dict[str, Any]:
    rows: list[dict[str, float]] = []
    heavy: list[str] = []
    for i in range(repeats):
        app = start_appliance(repository, load)
        try:
            app.wait_ready(300)
            time.sleep(settle_s)
            server = app.server_pid()
            assert server is not None, "no server child"
            sup, srv = memory(app.pid), memory(server)
            heavy = imported_heavy(app.pid)
            row = {f"supervisor_{k}": v for k, v in sup.items()} | {f"server_{k}": v for k, v in srv.items()}
            for key in ("rss_mb", "uss_mb", "pss_mb"):
                if key in sup and key in srv:
                    row[f"total_{key}"] = sup[key] + srv[key]
            rows.append(row)
            progress(
                f"idle memory [{label}] {i + 1}/{repeats}: supervisor RSS {sup['rss_mb']:.1f} MB "
                f"(USS {sup.get('uss_mb', float('nan')):.1f}), server RSS {srv['rss_mb']:.1f} MB "
                f"(USS {srv.get('uss_mb', float('nan')):.1f}), total RSS {row['total_rss_mb']:.1f} MB"
            )
        finally:
            app.stop()
            shutil.rmtree(app.tmp, ignore_errors=True)
        time.sleep(0.5)
    result: dict[str, Any] = {key: summary([r[key] for r in rows]) for key in rows[0]}
    result["supervisor_maps_heavy"] = heavy
    return result


def loaded_memory(repository: Path, seconds: float, clients: int) -> dict[str, Any]:
    """mlp under load: half the client threads on HTTP (JSON, requests), half on gRPC (tritonclient)."""
    import requests
    import tritonclient.grpc as grpcclient

    app = start_appliance(repository, ["mlp"])
    try:
        app.wait_ready(300)
        time.sleep(2)
        server = app.server_pid()
        assert server is not None
        idle = memory(app.pid)["rss_mb"] + memory(server)["rss_mb"]
        data = np.random.default_rng(0).random((1, 16), dtype=np.float32)
        body = {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": data.ravel().tolist()}
            ]
        }
        url = f"http://127.0.0.1:{app.http_port}/v2/models/mlp/infer"
        stop_at = time.monotonic() + seconds
        counts = {"http": 0, "grpc": 0, "errors": 0}
        lock = threading.Lock()

        def http_worker() -> None:
            with requests.Session() as session:
                while time.monotonic() < stop_at:
                    ok = session.post(url, json=body, timeout=10).status_code == 200
                    with lock:
                        counts["http" if ok else "errors"] += 1

        def grpc_worker() -> None:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{app.grpc_port}")
            tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            tensor.set_data_from_numpy(data)
            while time.monotonic() < stop_at:
                try:
                    client.infer("mlp", [tensor])
                    key = "grpc"
                except Exception:
                    key = "errors"
                with lock:
                    counts[key] += 1
            client.close()

        workers = [
            threading.Thread(target=http_worker if i % 2 == 0 else grpc_worker, daemon=True)
            for i in range(clients)
        ]
        for w in workers:
            w.start()
        samples: list[tuple[float, float, float]] = []
        while any(w.is_alive() for w in workers):
            samples.append((memory(app.pid)["rss_mb"], memory(server)["rss_mb"], time.monotonic()))
            time.sleep(0.5)
        end_sup, end_srv = memory(app.pid), memory(server)
        totals = [a + b for a, b, _ in samples]
        result = {
            "idle_total_rss_mb": idle,
            "peak_total_rss_mb": max(totals),
            "peak_server_rss_mb": max(b for _, b, _ in samples),
            "peak_supervisor_rss_mb": max(a for a, _, _ in samples),
            "end_total_rss_mb": end_sup["rss_mb"] + end_srv["rss_mb"],
            "end_server": end_srv,
            "end_supervisor": end_sup,
            "requests": counts,
            "seconds": seconds,
            "clients": clients,
            "req_per_s": (counts["http"] + counts["grpc"]) / seconds,
        }
        progress(
            f"load: {counts} in {seconds:.0f}s; total RSS idle {idle:.1f} MB, peak "
            f"{result['peak_total_rss_mb']:.1f} MB, end {result['end_total_rss_mb']:.1f} MB"
        )
        return result
    finally:
        app.stop()
        shutil.rmtree(app.tmp, ignore_errors=True)


# -- c: installed size ----------------------------------------------------------------------------------
def du_bytes(path: Path) -> int:
    return int(
        subprocess.run(["du", "-sb", str(path)], check=True, capture_output=True, text=True).stdout.split()[0]
    )


def installed_size(extra: str) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="es-venv-"))
    try:
        empty, full = work / "empty", work / "full"
        for venv in (empty, full):
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # no pip upgrade in either: both carry the same bundled pip, which the difference cancels
        t0 = time.monotonic()
        progress(f"pip install '{ROOT}[{extra}]' into a fresh venv (non-editable)")
        pip = subprocess.run(
            [
                str(full / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                f"{ROOT}[{extra}]",
            ],
            capture_output=True,
            text=True,
        )
        if pip.returncode != 0:
            raise RuntimeError(f"pip install failed:\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}")
        install_s = time.monotonic() - t0
        empty_b, full_b = du_bytes(empty), du_bytes(full)
        site = next((full / "lib").glob("python*/site-packages"))
        folders: dict[str, int] = {}
        for item in site.iterdir():
            if item.name.endswith((".dist-info", ".egg-info")) or item.name in ("__pycache__",):
                continue
            folders[item.name] = du_bytes(item)
        # group by distribution: map each top-level folder/file to the distribution whose RECORD names it
        owner: dict[str, str] = {}
        for dist in site.glob("*.dist-info"):
            record = dist / "RECORD"
            name = dist.name.split("-")[0]
            if record.exists():
                for line in record.read_text(errors="replace").splitlines():
                    first = line.split(",")[0].split("/")[0]
                    if first and not first.endswith(".dist-info") and first != "..":
                        owner.setdefault(first, name)
        by_dist: dict[str, int] = {}
        for item_name, size in folders.items():
            dist_name = owner.get(item_name, item_name)
            by_dist[dist_name] = by_dist.get(dist_name, 0) + size
        baseline = {
            d.name.split("-")[0].lower()
            for d in next((empty / "lib").glob("python*/site-packages")).glob("*.dist-info")
        }
        for name in list(by_dist):  # pip/setuptools: in both venvs, not part of the install
            if name.lower() in baseline:
                by_dist.pop(name)
        freeze = subprocess.run(
            [str(full / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True
        ).stdout.split()
        top = sorted(by_dist.items(), key=lambda kv: -kv[1])
        show = subprocess.run(
            [str(full / "bin" / "python"), "-m", "pip", "show", *(n for n, _ in top[:10])],
            capture_output=True,
            text=True,
        ).stdout
        required_by: dict[str, str] = {}
        current = ""
        for line in show.splitlines():
            if line.startswith("Name:"):
                current = line.split(":", 1)[1].strip()
            elif line.startswith("Required-by:"):
                required_by[current.lower().replace("-", "_")] = line.split(":", 1)[1].strip()
        return {
            "extra": extra,
            "install_s": install_s,
            "venv_mb": full_b / MB,
            "empty_venv_mb": empty_b / MB,
            "installed_mb": (full_b - empty_b) / MB,
            "top10_mb": [
                (name, size / MB, required_by.get(name.lower().replace("-", "_"), ""))
                for name, size in top[:10]
            ],
            "all_mb": {name: size / MB for name, size in top},
            "packages": freeze,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- report ---------------------------------------------------------------------------------------------
def verdict(value: float, target: float) -> str:
    return f"{'met' if value < target else 'MISSED'} ({value / target:.2f}x of the target)"


def target_row(label: str, value: str, measured: float, target: str) -> str:
    """A table row showing `value`, with `measured` checked against the size TARGETS[target] (MB)."""
    limit = TARGETS[target]
    return f"| {label} | {value} | < {limit:.0f} MB | {verdict(measured, limit)} |"


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"Machine: {res['machine']}; edgeserve at {res.get('code', 'unknown')}",
        "",
        "| measure | median (min-max, n) | target | verdict |",
        "|---|---|---|---|",
    ]
    ready = res.get("ready", {})
    for key, label, target in (
        ("empty", "start → READY=1, empty repository", TARGETS["ready_empty_s"]),
        ("mlp", "start → READY=1, mlp only (ORT)", None),
        ("full", "start → READY=1, 4 sample models", None),
    ):
        if key in ready:
            s = ready[key]["ready_s"]
            lines.append(
                f"| {label} | {fmt(s, ' s', 3)} | {f'< {target:.0f} s' if target else '—'} | "
                f"{verdict(s['median'], target) if target else ''} |"
            )
    if "empty" in ready:
        s = ready["empty"]["stop_s"]
        lines.append(f"| SIGTERM → exit 0, empty repository | {fmt(s, ' s', 3)} | — | |")
    idle = res.get("idle", {})
    if "empty" in idle:
        m = idle["empty"]
        rss = m["supervisor_rss_mb"]
        lines.append(
            target_row("supervisor alone, RSS", fmt(rss, " MB", 1), rss["median"], "supervisor_rss_mb")
        )
        for key in ("supervisor_uss_mb", "supervisor_pss_mb"):
            if key in m:
                lines.append(
                    f"| supervisor alone, {key.split('_')[1].upper()} | {fmt(m[key], ' MB', 1)} | | |"
                )
        lines.append(f"| server child, empty repository, RSS | {fmt(m['server_rss_mb'], ' MB', 1)} | | |")
    if "mlp" in idle:
        m = idle["mlp"]
        rss, label = m["total_rss_mb"], "supervisor + server, mlp on ORT, idle RSS"
        lines.append(target_row(label, fmt(rss, " MB", 1), rss["median"], "mlp_rss_mb"))
        for key in ("total_uss_mb", "total_pss_mb", "supervisor_rss_mb", "server_rss_mb", "server_uss_mb"):
            if key in m:
                lines.append(
                    f"| … {key.replace('_mb', '').replace('_', ' ')} | {fmt(m[key], ' MB', 1)} | | |"
                )
    if "load" in res:
        ld = res["load"]
        label = (
            f"mlp under load ({ld['clients']} threads HTTP+gRPC, {ld['seconds']:.0f} s, "
            f"{ld['req_per_s']:.0f} req/s): total RSS peak / end"
        )
        peak = ld["peak_total_rss_mb"]
        value = f"{peak:.1f} / {ld['end_total_rss_mb']:.1f} MB (idle {ld['idle_total_rss_mb']:.1f})"
        lines.append(target_row(label, value, peak, "mlp_rss_mb"))
    if "full" in idle:
        m = idle["full"]
        r = m["total_rss_mb"]["median"]
        lines.append(
            f"| supervisor + server, 4 sample models, idle RSS | {fmt(m['total_rss_mb'], ' MB', 1)} | "
            f"(was {BEFORE_FULL_RSS_MB:.0f} MB, one process) | {r / BEFORE_FULL_RSS_MB:.2f}x of before |"
        )
        if "total_uss_mb" in m:
            lines.append(f"| … total USS | {fmt(m['total_uss_mb'], ' MB', 1)} | | |")
    if "install" in res:
        ins = res["install"]
        label = f"pip install .[{ins['extra']}], venv minus empty venv"
        lines.append(target_row(label, f"{ins['installed_mb']:.1f} MB", ins["installed_mb"], "install_mb"))
        lines += [
            "",
            "Largest distributions in site-packages (MB; pip/setuptools of the empty venv left out):",
            "",
            "| package | MB | share | required by |",
            "|---|--:|--:|---|",
        ]
        for name, size, by in ins["top10_mb"]:
            lines.append(f"| {name} | {size:.1f} | {100 * size / ins['installed_mb']:.0f}% | {by} |")
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="starts per repository (default 5)")
    parser.add_argument("--memory-repeats", type=int, default=3, help="idle memory starts per repository")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds idle after READY before sampling")
    parser.add_argument("--load-seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument(
        "--extra", default="onnxruntime", help="the pip extra to install (default onnxruntime)"
    )
    parser.add_argument("--skip-install", action="store_true")
    parser.add_argument("--only", default="ready,memory,load,install", help="comma list of parts")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    res: dict[str, Any] = {"machine": machine_facts(), "code": code_version(), "targets": TARGETS}
    progress(f"{res['machine']}; edgeserve at {res['code']}")
    with temp_repository([]) as empty, temp_repository(["mlp"]) as mlp_repo:
        if "ready" in parts:
            res["ready"] = {
                "empty": time_ready("empty repository", empty, [], args.repeats, 60),
                "mlp": time_ready("mlp", mlp_repo, ["mlp"], args.repeats, 120),
                "full": time_ready(
                    "4 sample models", MODELS, list(SAMPLE_MODELS), max(2, args.repeats // 2), 300
                ),
            }
        if "memory" in parts:
            res["idle"] = {
                "empty": idle_memory("empty repository", empty, [], args.memory_repeats, args.settle),
                "mlp": idle_memory("mlp", mlp_repo, ["mlp"], args.memory_repeats, args.settle),
                "full": idle_memory(
                    "4 sample models", MODELS, list(SAMPLE_MODELS), args.memory_repeats, args.settle
                ),
            }
        if "load" in parts:
            res["load"] = loaded_memory(mlp_repo, args.load_seconds, args.clients)
    if "install" in parts and not args.skip_install:
        res["install"] = installed_size(args.extra)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"appliance-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=2, default=str))
    progress(f"wrote {out}")
    print(markdown(res))


if __name__ == "__main__":
    main()
