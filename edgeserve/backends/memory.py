"""Runtime memory settings: the memory profile (`[runtime] memory_profile`) and what it sets.

"auto" (the default) is "small" on a device with at most `SMALL_BOARD_BYTES` of memory (MemTotal, or
the cgroup's memory limit when lower: the hardware probe's figure), else "standard". Each knob was
measured with benchmarks/bench_memory.py (the sample appliance under mixed traffic) and kept only where
it helped; what each costs is said beside it. A model's own config parameters win over the profile
(e.g. `CPU_RUNTIME_CACHE_CAPACITY`, `ort_memory_pattern`), and an environment variable already set
for the process (ONEDNN_PRIMITIVE_CACHE_CAPACITY, MALLOC_*) wins over both.

Process-wide knobs are applied once by `tune_server_process` at server start, before any runtime is
imported or any thread is started; the backends read the resolved profile with `current()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("edgeserve.backends.memory")

PROFILES = ("auto", "small", "standard")
SMALL_BOARD_BYTES = 4 * 2**30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc mallopt parameters (malloc.h)
JANITOR_S = 5.0


@dataclass(frozen=True)
class MemoryProfile:
    name: str
    why: str
    # OpenVINO CPU plugin: prepared executors kept per input shape (the plugin's default is 5000; a
    # dynamic-shape model such as PP-OCR rec kept ~7 MB per shape seen, without bound).
    ov_runtime_cache: int
    # oneDNN's JIT-compiled primitives kept per shape (default 1024): OpenVINO's CPU plugin uses it
    # too; the rest of the per-shape growth.
    onednn_primitive_cache: int
    # OpenVINO: release a compiled model's intermediate buffers (CompiledModel.release_memory) once it
    # has been idle this long; 0 = after every call (the next call allocates them again); < 0 = never.
    ov_release_idle_s: float
    # glibc arenas in the server process (default 8 x cores): threads that allocate each keep one.
    malloc_arena_max: int
    # Server process: allocations from this size on are mmapped and given back when freed; below it,
    # buffers are reused without page faults. 0 = glibc's own threshold, which rises with each large
    # free up to 32 MB, so tensors then come from the heap (it keeps its high-water mark). A fixed 4 MB
    # made ONNX Runtime (arena off) map and fault in every activation of a batch of 8 ResNet-50 frames
    # on each call: ~10k page faults, +20% CPU per image (issue 36; docs/hardware.md has the figures).
    server_mmap_threshold: int
    # Server process: when RSS grew by this much since the last look (every JANITOR_S), freed heap
    # pages are given back (malloc_trim) and the cyclic GC runs. 0 = never.
    server_trim_growth: int
    # Python workers: glibc keeps freed blocks under the mmap threshold and up to the trim threshold
    # of free heap top for the next call (frame-sized arrays are not page-faulted in again).
    worker_mmap_threshold: int
    worker_trim_threshold: int
    # The plan leaves OpenVINO out for models with dynamic dims on the CPU (unless the config names
    # it): its CPU plugin keeps kernels and buffers per shape seen (~100 MB for PP-OCR det and rec after
    # a few hundred frames, with the caches above at 0), where ONNX Runtime with its arena off frees a
    # call's buffers when the call ends. The cost: those models run slower (here PP-OCR det and rec
    # ran 2-4x slower on ONNX Runtime than on OpenVINO bf16).
    lean_dynamic_shapes: bool
    # Python models: bytes of an instance's shared-memory region kept resident after a call; the pages
    # beyond are handed back (the region keeps the size of the largest call, so without this a large
    # call's pages stayed resident in the server and the worker both).
    worker_region_keep: int
    # ONNX Runtime's memory arena for models without dynamic dims beyond the batch axis (unless
    # `[runtime] ort_memory_arena` or a model's parameter says): it keeps a call's peak activations for
    # the next call. Off, every activation is malloc'ed and freed per call; those of a batch of 8
    # ResNet-50 frames (3-25 MB each) are then mapped and faulted in afresh each time, from an instance
    # thread's glibc arena whatever the mmap threshold: up to 1,300 page faults and 3-20% more server
    # CPU per image here; on, ~90 MB more RSS (docs/hardware.md). Never for dynamic dims: the arena
    # would keep the peak of every shape seen.
    ort_memory_arena: bool
    # Dynamic batching: bytes of free gather buffers kept per model version (scheduling/buffers.py),
    # so a batch is gathered into pages already mapped instead of fresh ones faulted in per batch.
    batch_buffer_bytes: int


STANDARD = MemoryProfile(
    name="standard",
    why="",
    ov_runtime_cache=16,
    onednn_primitive_cache=64,
    ov_release_idle_s=10.0,
    malloc_arena_max=2,
    server_mmap_threshold=0,
    server_trim_growth=32 << 20,
    lean_dynamic_shapes=False,
    worker_mmap_threshold=32 << 20,
    worker_trim_threshold=16 << 20,
    worker_region_keep=16 << 20,
    ort_memory_arena=True,
    batch_buffer_bytes=64 << 20,
)
SMALL = MemoryProfile(
    name="small",
    why="",
    ov_runtime_cache=0,
    onednn_primitive_cache=0,
    ov_release_idle_s=1.0,
    malloc_arena_max=2,
    server_mmap_threshold=1 << 20,
    server_trim_growth=8 << 20,
    lean_dynamic_shapes=True,
    worker_mmap_threshold=4 << 20,
    worker_trim_threshold=8 << 20,
    worker_region_keep=1 << 20,
    ort_memory_arena=False,
    batch_buffer_bytes=8 << 20,
)
_current = STANDARD


def resolve(setting: str, memory_bytes: int | None, memory_reason: str = "device memory") -> MemoryProfile:
    """The profile for `[runtime] memory_profile` on a device with `memory_bytes` (None: unknown)."""
    if setting == "small":
        return _with_why(SMALL, "[runtime] memory_profile = small")
    if setting == "standard":
        return _with_why(STANDARD, "[runtime] memory_profile = standard")
    if memory_bytes is not None and memory_bytes <= SMALL_BOARD_BYTES:
        return _with_why(SMALL, f"auto: {memory_bytes / 2**20:.0f} MiB ({memory_reason}) <= 4096 MiB")
    known = f"{memory_bytes / 2**20:.0f} MiB ({memory_reason})" if memory_bytes else "memory size unknown"
    return _with_why(STANDARD, f"auto: {known}")


REFUSAL = "memory profile "  # how plan_refusal's reasons start (the plan tells them from hard ones)


def plan_refusal(profile: MemoryProfile, backend: str, device: str, dynamic_dims: bool) -> str | None:
    """Why the runtime plan should prefer another option to `backend` on `device` for a model under this
    profile (a preference: the plan still takes it when no other option can run the model)."""
    cpu = device.split(":")[0] == "CPU"
    if profile.lean_dynamic_shapes and backend == "openvino" and cpu and dynamic_dims:
        return (
            f"{REFUSAL}{profile.name}: OpenVINO's CPU plugin keeps kernels and buffers per input shape "
            "of a model with dynamic dims, ONNX Runtime frees them after each call (set backend: "
            '"openvino" in config.pbtxt to use it anyway)'
        )
    return None


def _with_why(profile: MemoryProfile, why: str) -> MemoryProfile:
    return dataclasses.replace(profile, why=why)


def current() -> MemoryProfile:
    """The profile this process runs with (STANDARD until `tune_server_process` or `use` sets one)."""
    return _current


def ort_memory_arena(setting: bool | None, profile: MemoryProfile | None = None) -> str:
    """The `ort_memory_arena` parameter a model's ONNX Runtime session gets: `[runtime]
    ort_memory_arena` where it is set ("true"/"false"), else the profile's: "auto" (on where the
    model has no dynamic dims beyond the batch axis: backends/onnxruntime.py) or "false"."""
    if setting is not None:
        return "true" if setting else "false"
    return "auto" if (profile or current()).ort_memory_arena else "false"


def use(profile: MemoryProfile) -> None:
    global _current
    _current = profile


def device_memory(hardware_root: Path | str = "/") -> tuple[int | None, str]:
    """(bytes, where the figure comes from): MemTotal, or the cgroup's memory limit when lower."""
    from edgeserve.hardware.probes._fs import FsRoot
    from edgeserve.hardware.probes.memory import probe_cgroup, probe_memory, resource_budget

    root = FsRoot(hardware_root)
    budget = resource_budget(1, probe_memory(root), probe_cgroup(root))
    return budget.memory_bytes, budget.memory_reason


def tune_server_process(settings: Any, environ: Any = None) -> MemoryProfile:
    """Resolve the profile from the settings and the device, and apply the process-wide knobs (the
    glibc arena cap, the oneDNN cache) before any runtime or thread starts. Returns the profile."""
    env = os.environ if environ is None else environ
    memory, reason = device_memory(settings.runtime.hardware_root)
    profile = resolve(settings.runtime.memory_profile, memory, reason)
    use(profile)
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(profile.onednn_primitive_cache))
    # glibc read its environment when the process started: what it did not get there is set now.
    # 0 = glibc's own default (a fixed threshold would also stop glibc's dynamic one).
    for name, option, value in (
        ("MALLOC_ARENA_MAX", _M_ARENA_MAX, profile.malloc_arena_max),
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, profile.server_mmap_threshold),
        ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, profile.server_mmap_threshold * 2),
    ):
        if name not in env and value > 0:
            mallopt(option, value)
    if profile.server_trim_growth > 0:
        Janitor(profile.server_trim_growth).start()
    log.info("memory profile %s (%s)", profile.name, profile.why)
    return profile


def _libc() -> Any:
    return ctypes.CDLL("libc.so.6")


def mallopt(option: int, value: int) -> bool:
    """glibc's mallopt (False where there is no glibc)."""
    with contextlib.suppress(OSError, AttributeError):
        return bool(_libc().mallopt(option, int(value)))
    return False


def malloc_trim() -> None:
    """Give freed heap pages back to the system, in every arena (no-op without glibc)."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().malloc_trim(0)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Janitor:
    """Every `period_s`: when this process's RSS grew by `growth` bytes since the last clean-up, run
    the cyclic GC (responses caught in reference cycles hold their tensors until it runs) and hand
    freed heap pages back. Reading /proc/self/statm costs microseconds; a clean-up a few ms, and only
    follows growth, so an idle or steady server does nothing."""

    def __init__(self, growth: int, period_s: float = JANITOR_S) -> None:
        self.growth = growth
        self.period_s = period_s
        self.cleanups = 0
        self._stop = threading.Event()
        self._base = 0

    def start(self) -> None:
        threading.Thread(target=self._run, name="edgeserve-memory-janitor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> bool:
        """One look; True when it cleaned up."""
        now = rss_bytes()
        if not self._base or now < self._base:
            self._base = now
            return False
        if now - self._base < self.growth:
            return False
        gc.collect()
        malloc_trim()
        self.cleanups += 1
        self._base = rss_bytes()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.tick()


def worker_environment(base: Mapping[str, str], profile: MemoryProfile | None = None) -> dict[str, str]:
    """The environment of a Python model's worker process: the profile's glibc thresholds (unless set)."""
    profile = profile or current()
    env = dict(base)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(profile.worker_mmap_threshold))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(profile.worker_trim_threshold))
    env.setdefault("MALLOC_ARENA_MAX", str(profile.malloc_arena_max))
    return env
