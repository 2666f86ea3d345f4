"""A BLS call's inputs reach the called model without a copy when the model passes on an input of its
execute call unchanged (callref.py): the called model gets a read-only view whose memory is the
caller's per-call region, while a tensor the model computed itself comes through the event channel's
half (one copy, unavoidable). A call still running when execute returned (a model's own thread) holds
the execute reply, so the server never writes the next call's inputs under it. Real worker processes
(the Python backend's own load), the real DataPlane over tests/fake_plane.py's in-memory models."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_plane import FakeRepository, fake_plane
from pymodels import write_model

from edgeserve.backends import streams
from edgeserve.backends.base import BackendOptions, get_backend
from edgeserve.backends.python.backend import PythonBackend
from edgeserve.backends.python.instance import PythonInstance
from edgeserve.repository.config import parse_pbtxt
from edgeserve.server.bls import DataPlaneCaller

pytestmark = pytest.mark.timeout(180)
WAIT_S = 60.0  # generous (a loaded 2-core box); nothing here measures speed
TARGET = """
max_batch_size: 0
input [{ name: "A" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "B" data_type: TYPE_FP32 dims: [ -1 ] }]
output { name: "SUM" data_type: TYPE_FP32 dims: [ -1 ] }
"""
CALLER_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input {{ name: "A" data_type: TYPE_FP32 dims: [ -1 ] }}
output {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }}
"""
PASSES_ON = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A")
            b = pb_utils.Tensor("B", np.ones_like(a.as_numpy()))  # computed here: copied once
            answer = pb_utils.InferenceRequest(model_name="target", requested_output_names=["SUM"],
                                               inputs=[a, b]).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_output_tensor_by_name(answer, "SUM").as_numpy())]))
        return out
"""
PASSES_ON_ASYNC = (
    PASSES_ON.replace("    def execute", "    async def execute")
    .replace("inputs=[a, b]).exec()", "inputs=[a, b]).async_exec()")
    .replace("answer = pb_utils", "answer = await pb_utils")
)
LEAVES_RUNNING = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        a = pb_utils.get_input_tensor_by_name(requests[0], "A")
        b = pb_utils.Tensor("B", np.zeros_like(a.as_numpy()))
        request = pb_utils.InferenceRequest(model_name="target", requested_output_names=["SUM"],
                                            inputs=[a, b])
        threading.Thread(target=request.exec).start()  # not waited for: execute returns at once
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0], np.float32))])]
"""


def _owner(array: Any) -> Any:
    """The object whose memory `array` is (the end of its chain of bases)."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array.obj if isinstance(array, memoryview) else array


class Target:
    """The called model, in the server's process: what it received."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.entered = threading.Event()
        self.release: threading.Event | None = None
        self.instance: PythonInstance | None = None  # the caller: its worker's mappings at call time

    def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        a, b = inputs["A"], inputs["B"]
        worker = self.instance._worker if self.instance is not None else None
        assert worker is not None
        self.seen.append({"A": (_owner(a), a.flags.writeable, a.copy()), "B": (_owner(b), b.flags.writeable),
                          "region": worker.region.buffer, "half": worker.events.region.buffer})  # fmt: skip
        self.entered.set()
        if self.release is not None:
            assert self.release.wait(WAIT_S)
            self.seen[-1]["A after"] = a.copy()  # still the caller's input: the region was not reused
        return {"SUM": a + b}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Any, Target]]:
    target = Target()
    repo = FakeRepository(tmp_path)
    repo.add("target", TARGET, target)
    streams.install_caller(DataPlaneCaller(fake_plane(repo)))
    backend = get_backend("python")
    assert isinstance(backend, PythonBackend)
    made: list[PythonInstance] = []

    def load(name: str, source: str) -> PythonInstance:
        path = write_model(tmp_path / "models", name, source, CALLER_CONFIG.format(name=name))
        _, config = backend.inspect_config(path, parse_pbtxt(path.parent.parent / "config.pbtxt"), "t",
                                           BackendOptions())  # fmt: skip
        made.append(backend.load(path, config, BackendOptions()))
        target.instance = made[-1]
        return made[-1]

    try:
        yield load, target
    finally:
        for instance in made:
            instance.close()
        streams.install_caller(None)
        repo.close()


@pytest.mark.parametrize("source", [PASSES_ON, PASSES_ON_ASYNC], ids=["exec", "async_exec"])
def test_an_input_passed_on_reaches_the_called_model_as_a_view_of_the_callers_region(
    served: Any, source: str
) -> None:
    load, target = served
    instance = load("caller", source)
    a = np.arange(150_528, dtype=np.float32)  # 602 KB, the benchmark's tensor
    for _ in range(2):  # a second call reuses the region: still the right data
        a = a + 1
        out = instance.infer({"A": a})
        np.testing.assert_array_equal(out["OUT"], a + 1)
        seen = target.seen[-1]
        owner, writeable, value = seen["A"]
        assert isinstance(owner, mmap.mmap) and owner is seen["region"]  # no copy: the per-call region
        assert not writeable  # the caller's input: the called model may not write into it
        np.testing.assert_array_equal(value, a)
        assert seen["B"][0] is seen["half"]  # computed by the model: copied once into its half


def test_a_call_left_running_after_execute_holds_the_reply_until_it_ends(served: Any) -> None:
    load, target = served
    instance = load("leaves_running", LEAVES_RUNNING)
    target.release = threading.Event()
    a = np.arange(64, dtype=np.float32)
    first, second = threading.Event(), threading.Event()

    def call(values: np.ndarray, ended: threading.Event) -> None:
        instance.infer({"A": values})
        ended.set()

    threading.Thread(target=call, args=(a, first), daemon=True).start()
    assert target.entered.wait(WAIT_S)
    assert target.seen[0]["A"][0] is target.seen[0]["region"]
    # The next call would write its inputs where the running one reads: the worker's reply waits for
    # the call, so that call waits too. (Without the wait both would end within this second; on a
    # slow box the check could only miss a bug, never fail a correct build.)
    threading.Thread(target=call, args=(a + 100, second), daemon=True).start()
    assert not first.wait(1.0)
    target.release.set()
    assert first.wait(WAIT_S) and second.wait(WAIT_S)
    np.testing.assert_array_equal(target.seen[0]["A after"], a)  # read unchanged to its end
