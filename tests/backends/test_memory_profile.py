"""`[runtime] memory_profile` (edgeserve/backends/memory.py): validated at config load with an error
that names the file, the field and the values; "auto" follows the device's memory; what small changes
(the plan keeps OpenVINO off dynamic-shape CPU models, the workers' glibc thresholds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgeserve.backends import memory
from edgeserve.config import ConfigError, load_settings

GIB = 2**30


@pytest.mark.parametrize("value", ["small", "standard", "auto"])
def test_each_profile_is_accepted(tmp_path: Path, value: str) -> None:
    path = tmp_path / "edgeserve.toml"
    path.write_text(f'[runtime]\nmemory_profile = "{value}"\n')
    assert load_settings(path, environ={}).runtime.memory_profile == value
    assert load_settings(environ={"EDGESERVE_RUNTIME_MEMORY_PROFILE": value}).runtime.memory_profile == value


def test_a_bad_profile_names_the_file_the_field_and_the_values(tmp_path: Path) -> None:
    path = tmp_path / "edgeserve.toml"
    path.write_text('[runtime]\nmemory_profile = "tiny"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    text = str(info.value)
    assert str(path) in text and "runtime.memory_profile" in text
    assert "'tiny' is not one of auto, small, standard" in text
    with pytest.raises(
        ConfigError, match=r"runtime.memory_profile: 'Small' is not one of auto, small, standard"
    ):
        load_settings(environ={"EDGESERVE_RUNTIME_MEMORY_PROFILE": "Small"})


def test_auto_is_small_on_a_small_board() -> None:
    assert memory.resolve("auto", 2 * GIB).name == "small"
    assert memory.resolve("auto", 4 * GIB, "cgroup memory.max").name == "small"
    assert "cgroup memory.max" in memory.resolve("auto", 4 * GIB, "cgroup memory.max").why
    assert memory.resolve("auto", 8 * GIB).name == "standard"
    assert memory.resolve("auto", None).name == "standard"  # unknown: keep the faster settings
    assert memory.resolve("small", 64 * GIB).name == "small"  # an explicit choice wins
    assert memory.resolve("standard", 1 * GIB).name == "standard"


def test_small_keeps_openvino_off_dynamic_shapes_on_the_cpu() -> None:
    small, standard = memory.resolve("small", None), memory.resolve("standard", None)
    reason = memory.plan_refusal(small, "openvino", "CPU", dynamic_dims=True)
    assert reason is not None and "memory profile small" in reason and 'backend: "openvino"' in reason
    assert memory.plan_refusal(small, "openvino", "CPU", dynamic_dims=False) is None
    assert memory.plan_refusal(small, "openvino", "GPU.0", dynamic_dims=True) is None
    assert memory.plan_refusal(small, "onnxruntime", "CPU", dynamic_dims=True) is None
    assert memory.plan_refusal(standard, "openvino", "CPU", dynamic_dims=True) is None


def test_worker_environment_keeps_what_the_operator_set() -> None:
    small = memory.resolve("small", None)
    env = memory.worker_environment({"MALLOC_ARENA_MAX": "4"}, small)
    assert env["MALLOC_ARENA_MAX"] == "4"
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(small.worker_mmap_threshold)
    assert env["MALLOC_TRIM_THRESHOLD_"] == str(small.worker_trim_threshold)


def test_the_janitor_cleans_up_only_after_growth() -> None:
    janitor = memory.Janitor(growth=8 << 20, period_s=3600)
    assert not janitor.tick()  # the first look sets the base
    ballast = bytearray(32 << 20)  # touched pages: RSS grows past the threshold
    ballast[::4096] = b"x" * len(ballast[::4096])
    assert janitor.tick() and janitor.cleanups == 1
    assert not janitor.tick()  # no growth since
    del ballast


_FAULTS = """
import ctypes, resource, sys
from edgeserve.backends import memory
from edgeserve.config import load_settings
memory.tune_server_process(load_settings(environ={"EDGESERVE_RUNTIME_MEMORY_PROFILE": sys.argv[1]}), {})
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 8 << 20  # an activation of a batch of 8 ResNet-50 frames is 3-25 MB
def cycle():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)  # a runtime writes what it allocates
    libc.free(block)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    cycle()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def test_standard_reuses_large_freed_blocks_and_small_gives_them_back() -> None:
    """The price list's rule (issue 36): `standard` costs no speed, so a freed 8 MB block is reused from
    the heap (glibc's own threshold) rather than mapped and faulted in again per call, as `small`
    does to keep RSS down (1 MB threshold). Counted in page faults, not timed."""
    import subprocess
    import sys

    def faults(profile: str) -> float:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", _FAULTS, profile], capture_output=True, text=True,
                             env=env, timeout=120, check=True)  # fmt: skip
        return float(out.stdout.strip().splitlines()[-1])

    pages = (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    standard, small = faults("standard"), faults("small")
    assert standard < pages / 4, standard  # reused (what is left: the interpreter's own small faults)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if "[always]" not in (thp.read_text() if thp.exists() else ""):  # else a fresh map is a few 2 MB faults
        assert small > pages / 2, small  # mapped afresh and faulted in, page by page, every time
