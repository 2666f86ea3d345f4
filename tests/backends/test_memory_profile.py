"""`[runtime] memory_profile` (edgeserve/backends/memory.py): validated at config load with an error
that names the file, the field and the values; "auto" follows the device's memory; what small changes
(the plan keeps OpenVINO off dynamic-shape CPU models, the workers' glibc thresholds)."""

from __future__ import annotations

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
