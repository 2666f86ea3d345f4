"""What the supervisor tells people: the runtime plan in the state folder and the STATUS= line that
`systemctl status` shows."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from edgeserve import __version__
from edgeserve.config import Settings
from edgeserve.fsutil import write_json_atomic
from edgeserve.supervisor.control import ModelState
from edgeserve.supervisor.waker import Waker

log = logging.getLogger("edgeserve.supervisor")

PLAN_FILE = "runtime-plan.json"


def device_plan(settings: Settings) -> dict[str, Any]:
    """Hardware, runtimes, device profile and budgets: the probe half of the runtime plan (pure file
    reads, no runtime import). The server fills in the per-model half as it loads."""
    from edgeserve.hardware.plan import Planner
    from edgeserve.hardware.probes import probe_hardware
    from edgeserve.hardware.profile import load_profiles, match_profile
    from edgeserve.hardware.runtimes import detect_runtimes

    root = settings.runtime.hardware_root
    hw = probe_hardware(root)
    runtimes = detect_runtimes(root)
    profile = match_profile(hw, load_profiles([settings.runtime.device_profiles]))
    planner = Planner(hw, profile, runtimes, settings, None)
    threads, threads_why = planner.threads()
    return {
        "edgeserve": __version__,
        "probed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hardware_root": str(root),
        "hardware": hw.to_dict(),
        "runtimes": {
            name: {"available": info.available, "version": info.version}
            for name, info in runtimes.runtimes.items()
        },
        "ort_providers": list(runtimes.ort_providers()),
        "profile": {"name": profile.name, "description": profile.description, "source": profile.source},
        "threads": {"count": threads, "reason": threads_why},
        "memory_budget_bytes": planner.memory_budget(),
        "models": {},
    }


def write_plan(path: Path, settings: Settings, models: dict[str, object] | None = None) -> None:
    try:
        plan = device_plan(settings)
        plan["models"] = models or {}
        write_json_atomic(path, plan)
    except OSError as exc:
        log.warning("cannot write the runtime plan to %s: %s", path, exc)


Call = tuple[Callable[[], Any], list[Any], threading.Event]


class LoopCalls:
    """Work other threads (the fleet agent) hand to the supervisor's loop, which owns the child and
    the settings; each caller waits for its own result."""

    def __init__(self, wake: Waker) -> None:
        self._wake = wake
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = (
            queue.SimpleQueue()
        )

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        done, box = threading.Event(), list[Any]()
        self._queue.put((fn, box, done))
        self._wake.set()
        if not done.wait(timeout_s):
            raise TimeoutError("the supervisor did not get to it in time")
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return box[0] if box else None

    def run_pending(self) -> None:
        while not self._queue.empty():
            fn, box, done = self._queue.get_nowait()
            try:
                box.append(fn())
            except Exception as exc:
                box.append(exc)
            done.set()


def device_accelerators(settings: Settings) -> set[str]:
    """Names a bundle's `compatible.accelerators` may ask for (one of them must be here)."""
    from edgeserve.hardware.probes import probe_hardware

    hw = probe_hardware(settings.runtime.hardware_root)
    found = {"cpu"}
    if hw.jetson is not None:
        found |= {"jetson", "cuda", "nvidia-gpu"}
    if hw.nvidia_dgpu is not None:
        found |= {"cuda", "nvidia-gpu"}
    if hw.intel.gpus:
        found.add("intel-gpu")
    if hw.intel.npus:
        found.add("intel-npu")
    if hw.neuron is not None:
        found.add("neuron")
    return found


def served_models(configs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """The per-model half of the plan, from each ready model's served config."""
    models: dict[str, Any] = {}
    for name, config in configs.items():
        if config is None:
            continue
        parameters = {
            key: value.get("string_value", "")
            for key, value in (config.get("parameters") or {}).items()
            if isinstance(value, Mapping)
        }
        groups = config.get("instance_group") or []
        models[name] = {
            "backend": config.get("backend") or config.get("platform") or "",
            "max_batch_size": config.get("max_batch_size", 0),
            "instances": sum(int(g.get("count", 1)) for g in groups if isinstance(g, Mapping)) or 1,
            "parameters": parameters,
        }
    return models


def status_line(
    phase: str,
    models: Iterable[ModelState],
    backends: Mapping[str, str],
    expected: set[str] | None,
    restarts: int,
    note: str,
    last_error: str,
) -> str:
    """One line for `systemctl status`: what is served on what, what is wrong, how often it restarted."""
    latest: dict[str, ModelState] = {}
    for model in models:
        wanted = expected is None or model.name in expected
        if wanted and (model.name not in latest or model.state == "READY"):
            latest[model.name] = model
    ready = sorted(name for name, m in latest.items() if m.state == "READY")
    parts = [phase]
    if latest or expected:
        total = len(expected) if expected is not None else len(latest)
        served = ", ".join(f"{name}={backends.get(name) or '?'}" for name in ready)
        parts.append(f"{len(ready)}/{total} models ready" + (f" ({served})" if served else ""))
        waiting = sorted(
            f"{name} {m.state.lower() or 'not loaded'}" + (f": {m.reason}" if m.reason else "")
            for name, m in latest.items()
            if m.state != "READY"
        )
        if waiting:
            parts.append("; ".join(waiting))
    if note:
        parts.append(note)
    if restarts:
        parts.append(f"{restarts} restart{'s' if restarts != 1 else ''}")
    if last_error:
        parts.append(f"last error: {last_error}")
    return " · ".join(parts)[:1000].replace("\n", " ")
