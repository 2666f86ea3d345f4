"""The appliance's memory, per process and per model (for `/metrics` and `edgeserve models list`).

Per process (psutil, /proc/<pid>/smaps_rollup): the server, the supervisor that started it, and each
Python model worker (a `python_worker_group` worker once, with its models).
  rss  resident pages, shared library pages included: what `ps` and `top` show. Summed over the
       processes it counts a page every process maps (libc, libpython, numpy, a Python model's shared
       tensor region) once per process: the issue's figure ("total RSS"), an upper bound.
  pss  each page divided by the number of processes that map it: summed, the memory the appliance
       really holds (no double counting).
  uss  pages only this process maps: what its exit would give back.

Per model (what its backend holds, as far as the runtime says):
  weights  ONNX Runtime: the model file(s) (the initializers; ORT may keep a prepacked copy beside);
           OpenVINO: the compiled graph's constants at their runtime precision (bf16: half of f32).
  worker_rss / worker_pss / worker_uss  Python models: their worker process (shared by a group's models).
Activations and runtime scratch are not per model (a runtime frees or reuses them across calls): they
are in the server's RSS, and `edgeserve_model_memory_bytes` (the budget's measured RSS growth at load)
holds the rest of what a load cost.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

KINDS = ("rss", "pss", "uss")
SERVER, SUPERVISOR, PYTHON_WORKER = "server", "supervisor", "python_worker"
MIB = 2**20


@dataclass
class ProcessMemory:
    role: str
    pid: int
    name: str = ""
    models: list[str] = field(default_factory=list)
    rss: int = 0
    pss: int = 0
    uss: int = 0


def measure(pid: int) -> tuple[int, int, int] | None:
    """(rss, pss, uss) in bytes; None when the process is gone or unreadable (pss/uss 0 where the
    kernel has no smaps)."""
    import psutil

    try:
        info = psutil.Process(pid).memory_full_info()
    except (psutil.Error, OSError):
        try:
            return int(psutil.Process(pid).memory_info().rss), 0, 0
        except (psutil.Error, OSError):
            return None
    return int(info.rss), int(getattr(info, "pss", 0)), int(getattr(info, "uss", 0))


def supervisor_pid(environ: Mapping[str, str] | None = None) -> int | None:
    """The supervisor that started this server (`edgeserve run`), when it is still our parent."""
    env = os.environ if environ is None else environ
    raw = env.get("EDGESERVE_SUPERVISED_BY", "")
    return int(raw) if raw.isdigit() and int(raw) == os.getppid() else None


def python_workers() -> list[tuple[int, str, str]]:
    """(pid, worker name, model) of the Python model workers; none when no Python model was loaded
    (the backend is not imported for that)."""
    if "edgeserve.backends.python.process" not in sys.modules:
        return []
    from edgeserve.backends.python.process import live_workers

    return live_workers()


def processes() -> list[ProcessMemory]:
    """This server, its supervisor, its Python workers (one entry per process)."""
    found = [ProcessMemory(SERVER, os.getpid())]
    parent = supervisor_pid()
    if parent is not None:
        found.append(ProcessMemory(SUPERVISOR, parent))
    workers: dict[int, ProcessMemory] = {}
    for pid, name, model in python_workers():
        entry = workers.setdefault(pid, ProcessMemory(PYTHON_WORKER, pid, name))
        if model and model not in entry.models:
            entry.models.append(model)
    found += [workers[pid] for pid in sorted(workers)]
    measured = []
    for entry in found:
        figures = measure(entry.pid)
        if figures is None:
            continue
        entry.rss, entry.pss, entry.uss = figures
        entry.models.sort()
        measured.append(entry)
    return measured


def model_estimates(instances: Iterable[Any], workers: Mapping[int, ProcessMemory]) -> dict[str, int]:
    """kind -> bytes for one model version's instances: the backends' `memory_estimate()` summed, and
    for Python instances their worker processes (each process once)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for instance in instances:
        estimate = getattr(instance, "memory_estimate", None)
        if callable(estimate):
            with contextlib.suppress(Exception):  # a report must not fail on a closing instance
                for kind, value in estimate().items():
                    out[kind] = out.get(kind, 0) + int(value)
        pid = getattr(instance, "pid", None)
        if isinstance(pid, int) and pid in workers and pid not in seen:
            seen.add(pid)
            process = workers[pid]
            for kind in KINDS:
                out[f"worker_{kind}"] = out.get(f"worker_{kind}", 0) + getattr(process, kind)
    return out


# -- `edgeserve models list` ------------------------------------------------------------------------
def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _row(*cells: str) -> str:
    role, pid, rss, pss, uss, text = cells
    return f"{role:14} {pid:>7} {rss:>8} {pss:>8} {uss:>8}  {text}"


def render(families: Mapping[str, list[tuple[dict[str, str], float]]]) -> str:
    """The per-process and per-model tables from /metrics samples (family -> [(labels, value)])."""
    lines: list[str] = []
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for labels, value in families.get("edgeserve_process_memory_bytes", []):
        row = rows.setdefault((labels.get("pid", ""), labels.get("process", "")), {"labels": labels})
        row[labels.get("kind", "")] = value
    if rows:
        lines.append(_row("PROCESS", "PID", "RSS MiB", "PSS MiB", "USS MiB", "MODELS"))
        totals = dict.fromkeys(KINDS, 0.0)
        for (pid, role), row in sorted(
            rows.items(), key=lambda item: (_ORDER.get(item[0][1], 9), item[0][0])
        ):
            served, name = row["labels"].get("models", ""), row["labels"].get("name", "")
            shown = f"{served} ({name})" if served and name else served or name
            lines.append(_row(role, pid, *(_mib(row.get(kind)) for kind in KINDS), shown))
            for kind in KINDS:
                totals[kind] += float(row.get(kind, 0.0))
        note = "(RSS counts shared pages once per process, PSS once)"
        lines.append(_row("total", "", *(_mib(totals[kind]) for kind in KINDS), note))
    per_model: dict[tuple[str, str], dict[str, float]] = {}
    for labels, value in families.get("edgeserve_model_memory_estimate_bytes", []):
        kinds = per_model.setdefault((labels.get("model", ""), labels.get("version", "")), {})
        kinds[labels.get("kind", "")] = value
    if per_model:
        lines += ["", f"{'MODEL':24} {'VERSION':8} {'WEIGHTS MiB':>12} {'WORKER RSS':>11} {'WORKER PSS':>11}"]
        for (model, version), kinds in sorted(per_model.items()):
            figures = (_mib(kinds.get(k)) for k in ("weights", "worker_rss", "worker_pss"))
            lines.append(f"{model:24} {version:8} " + "{:>12} {:>11} {:>11}".format(*figures))
        lines.append("(WEIGHTS: what the runtime holds for the weights; WORKER: the Python model's worker")
        lines.append(" process, shared by a python_worker_group's models, counted once in the total above)")
    return "\n".join(lines)


_ORDER = {SUPERVISOR: 0, SERVER: 1, PYTHON_WORKER: 2}


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of the memory families in a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("edgeserve_process_memory_bytes", "edgeserve_model_memory_estimate_bytes")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    with contextlib.suppress(ValueError):
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                out[family.name] = [(dict(s.labels), float(s.value)) for s in family.samples]
    return out


def print_breakdown(base: str) -> None:
    """`edgeserve models list`: the tables for the server at `base`, after its index (nothing when its
    /metrics does not answer)."""
    text = breakdown_text(base)
    if text:
        print(f"\n{text}")


def breakdown_text(base: str) -> str:
    """The tables for a running server at `base` ("" when its /metrics does not answer)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
            text = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return ""
    return render(parse_metrics(text))
