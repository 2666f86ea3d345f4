"""Ensembles run only what a request needs, and nothing of a failed request that has not started:
Python step models that log every call to a file prove that a step whose outputs no requested output
needs never runs, and that a step still queued when another step of the same request fails is
cancelled in its model's queue (answered there, never run). The real repository, schedulers, data
plane and Python workers; what is queued is observed, never timed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from es_server import wait_until

from edgeserve.config import Settings
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.protocol.errors import InferenceError
from edgeserve.protocol.inference import InferRequest, InputTensor, RequestedOutput
from edgeserve.repository.manager import ModelRepository
from edgeserve.server.dataplane import DataPlane

pytestmark = pytest.mark.timeout(180)

# Y = X + 1, each call's X appended to the file the config's `log` parameter names (dims -1: no
# implicit warm-up call). X == -1 holds the call until the file `<log>.release` exists (a request
# that keeps the model's only instance busy).
COUNTER = """
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = json.loads(args["model_config"])["parameters"]["log"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            with open(self.log, "a") as log:
                log.write(f"{float(x.reshape(-1)[0])}\\n")
            if x.reshape(-1)[0] == -1:
                deadline = time.monotonic() + 60
                while not os.path.exists(self.log + ".release") and time.monotonic() < deadline:
                    time.sleep(0.01)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]))
        return responses
"""

# Fails every call, once the file `<log>.release` exists (so the test decides when).
GATED_FAILURE = COUNTER.replace(
    'responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]))',
    'raise RuntimeError("step failed on purpose")',
).replace("if x.reshape(-1)[0] == -1:", "if True:")


def _config(name: str, log: Path) -> str:
    return f"""
name: "{name}" backend: "python" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
parameters {{ key: "log" value: {{ string_value: "{log}" }} }}
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""


def _ensemble(name: str, steps: list[tuple[str, str, str]]) -> str:
    """An ensemble of steps (model, the tensor its X reads, the tensor its Y writes); every tensor a
    step writes is an output of the ensemble."""
    outputs = ", ".join(f'{{ name: "{out}" data_type: TYPE_FP32 dims: [ -1 ] }}' for _, _, out in steps)
    maps = ",\n".join(
        f'  {{ model_name: "{model}" input_map {{ key: "X" value: "{src}" }} '
        f'output_map {{ key: "Y" value: "{out}" }} }}'
        for model, src, out in steps
    )
    return f"""
name: "{name}" platform: "ensemble" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {outputs} ]
ensemble_scheduling {{ step [
{maps}
] }}
"""


# X -> count_a -> FIRST -> count_b -> SECOND
CHAIN = _ensemble("chain", [("count_a", "X", "FIRST"), ("count_b", "FIRST", "SECOND")])
# X -> fails (step 0) and X -> count_c (step 1), side by side
SIDE_BY_SIDE = _ensemble("side", [("fails", "X", "BAD"), ("count_c", "X", "GOOD")])


@pytest.fixture
def logs(tmp_path: Path) -> dict[str, Path]:
    return {name: tmp_path / f"{name}.log" for name in ("count_a", "count_b", "count_c", "fails")}


@pytest.fixture
async def plane(tmp_path: Path, logs: dict[str, Path]) -> AsyncIterator[DataPlane]:
    repo = tmp_path / "models"
    for name, log in logs.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(GATED_FAILURE if name == "fails" else COUNTER)
        (repo / name / "config.pbtxt").write_text(_config(name, log))
    for name, config in (("chain", CHAIN), ("side", SIDE_BY_SIDE)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
    settings = Settings()
    settings.server.model_repository = repo
    settings.server.state_dir = tmp_path / "state"
    settings.server.load_models = ["*"]
    settings.server.exit_timeout_s = 10.0
    repository = ModelRepository(settings)
    await repository.start()
    yield DataPlane(repository, SharedMemoryRegistry(False, [], 4))
    for log in logs.values():
        log.with_name(log.name + ".release").touch()  # nothing stays held
    await repository.close()


def _request(model: str, x: float, outputs: list[str] | None = None) -> InferRequest:
    wanted = [RequestedOutput(n) for n in outputs] if outputs is not None else None
    array = np.array([x], np.float32)
    return InferRequest(model, inputs=[InputTensor("X", "FP32", (1,), array)], outputs=wanted)


def _calls(log: Path) -> list[float]:
    return [float(line) for line in log.read_text().split()] if log.exists() else []


def _outputs(response: Any) -> dict[str, float]:
    return {o.name: float(np.asarray(o.data).reshape(-1)[0]) for o in response.outputs}


async def test_a_step_no_requested_output_needs_does_not_run(plane: DataPlane, logs: dict[str, Path]) -> None:
    assert _outputs(await plane.infer(_request("chain", 1.0, ["FIRST"]))) == {"FIRST": 2.0}
    assert _calls(logs["count_a"]) == [1.0] and _calls(logs["count_b"]) == []  # count_b never ran
    assert _outputs(await plane.infer(_request("chain", 5.0, ["SECOND"]))) == {"SECOND": 7.0}
    assert _calls(logs["count_a"]) == [1.0, 5.0] and _calls(logs["count_b"]) == [6.0]  # both needed
    assert _outputs(await plane.infer(_request("chain", 10.0))) == {"FIRST": 11.0, "SECOND": 12.0}
    assert _calls(logs["count_a"]) == [1.0, 5.0, 10.0] and _calls(logs["count_b"]) == [6.0, 11.0]
    steps = {s["name"]: s for s in plane.statistics()["model_stats"]}["chain"]["ensemble_steps"]
    assert [s["success"]["count"] for s in steps] == [3, 2]


async def test_a_failed_step_cancels_the_queued_steps_of_its_request(
    plane: DataPlane, logs: dict[str, Path]
) -> None:
    count_c: Any = plane.repository.get("count_c").scheduler
    holder = asyncio.create_task(plane.infer(_request("count_c", -1.0)))  # keeps count_c's instance busy
    assert await asyncio.to_thread(wait_until, lambda: _calls(logs["count_c"]) == [-1.0], 60)
    failing = asyncio.create_task(plane.infer(_request("side", 3.0)))
    # step 1's job waits in count_c's queue behind the holder; step 0 is inside fails' execute()
    queued = lambda: count_c.pending_count == 1 and _calls(logs["fails"]) == [3.0]  # noqa: E731
    assert await asyncio.to_thread(wait_until, queued, 60)
    logs["fails"].with_name("fails.log.release").touch()  # step 0 fails now
    with pytest.raises(InferenceError) as failed:
        await failing
    assert failed.value.message.startswith("ensemble 'side' step 0 'fails': ")
    assert "step failed on purpose" in failed.value.message
    assert count_c.pending_count == 0  # cancelled in the queue at once
    logs["count_c"].with_name("count_c.log.release").touch()
    assert _outputs(await holder) == {"Y": 0.0}
    assert await asyncio.to_thread(count_c.wait_idle, 30.0)
    assert _calls(logs["count_c"]) == [-1.0]  # the cancelled step never ran
    stats = {s["name"]: s for s in plane.statistics()["model_stats"]}
    assert stats["count_c"]["inference_stats"]["success"]["count"] == 1
    assert stats["count_c"]["inference_stats"]["fail"]["count"] == 1  # the cancelled job
    steps = stats["side"]["ensemble_steps"]
    assert [(s["success"]["count"], s["fail"]) for s in steps] == [(0, 1), (0, 0)]
    # the model serves on: a later request runs both steps (and fails at step 0 again)
    with pytest.raises(InferenceError, match="step 0 'fails'"):
        await plane.infer(_request("side", 4.0))
    assert await asyncio.to_thread(count_c.wait_idle, 30.0)
    assert _calls(logs["count_c"]) in ([-1.0], [-1.0, 4.0])  # submitted with step 0; may run first
