"""The models of the concurrency suite, built in the test (ONNX graphs with `onnx.helper`, Python
models as model.py), and their client-side references.

Every answer is a deterministic function of what the request sent, so a client can tell its own
answer from anybody else's:

- stateless (`AffineModel`): X [rows, 4] FP32 -> Y = ((X + pre) * k + c) * post. A row of X is
  [client, request counter, row, salt], so a wrong answer decodes back to whose it was. ONNX Runtime,
  OpenVINO (the same ONNX file), a Python model, the response cache, and an ensemble of Python steps
  around an ONNX step. `c` carries the model version for the reload tests (c = 1000 * version).
- sequences: conc_seq_models.py. The Python stateless model answers each row's request_id() (RID).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from conc_seq_models import SeqModel
from onnx import TensorProto, helper, numpy_helper
from onnx_models import _save

Array = npt.NDArray[Any]
WIDTH = 4  # columns of X: client, request counter, row, salt
VERSION_STEP = 1000.0  # c = VERSION_STEP * version for versioned models

# -- stateless models ---------------------------------------------------------------------------------


def build_affine(path: Path, k: float, c: float) -> Path:
    """X [N, 4] FP32 -> Y = X * k + c."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "k"], ["scaled"]), helper.make_node("Add", ["scaled", "c"], ["Y"])],
        "affine",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", WIDTH])],
        [
            numpy_helper.from_array(np.array([k], np.float32), "k"),
            numpy_helper.from_array(np.array([c], np.float32), "c"),
        ],
    )
    return Path(_save(graph, path))


# A Triton Python model: one response per request, each request's rows computed on their own.
PY_AFFINE = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils

K, C, INPUT, OUTPUT, ECHO_ID, DELAY_MS = {k!r}, {c!r}, {input!r}, {output!r}, {echo_id!r}, {delay_ms!r}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, INPUT).as_numpy()
            if DELAY_MS:  # 0..7 steps of DELAY_MS, from the salt column: some calls outlive a short deadline
                time.sleep(DELAY_MS * (int(x[0, 3]) % 8) / 1000)
            out = [pb_utils.Tensor(OUTPUT, (x * np.float32(K) + np.float32(C)).astype(np.float32))]
            if ECHO_ID:  # the request's own ID, per row: a batch must not mix up whose request is whose
                out.append(pb_utils.Tensor("RID", np.full((x.shape[0], 1), request.request_id().encode(),
                                                          dtype=np.object_)))
            responses.append(pb_utils.InferenceResponse(out))
        return responses
"""


def _io_config(input_name: str, output_name: str, echo_id: bool = False) -> str:
    rid = ', { name: "RID", data_type: TYPE_STRING, dims: [ 1 ] }' if echo_id else ""
    return (
        f'input [ {{ name: "{input_name}", data_type: TYPE_FP32, dims: [ {WIDTH} ] }} ]\n'
        f'output [ {{ name: "{output_name}", data_type: TYPE_FP32, dims: [ {WIDTH} ] }}{rid} ]\n'
    )


def _stateless_config(backend: str, instances: int, cached: bool, io: str, queue: int = 0) -> str:
    """`queue`: an explicit max_queue_size (no 0.5 s soft cap: a slow model's abandoned calls still
    hold their places, and a refusal there would be overload, not what the suite looks for)."""
    policy = f" default_queue_policy {{ max_queue_size: {queue} }}" if queue else ""
    extra = ""
    if backend == "openvino":  # f32 on purpose: a bf16 default would change the answers
        extra = 'parameters { key: "INFERENCE_PRECISION_HINT" value { string_value: "f32" } }\n'
    if cached:
        extra += "response_cache { enable: true }\n"
    return (
        f'backend: "{backend}"\nmax_batch_size: 8\n{io}'
        f"dynamic_batching {{ max_queue_delay_microseconds: 2000{policy} }}\n"
        f"instance_group [ {{ kind: KIND_CPU, count: {instances} }} ]\n{extra}"
    )


@dataclass(frozen=True)
class AffineModel:
    """Y = ((X + pre) * k + c) * post; an ensemble (pre/post as Python steps) when `ensemble`."""

    name: str
    backend: str  # onnxruntime, openvino, python; the core step's backend for an ensemble
    c: float
    k: float = 3.0
    cached: bool = False
    instances: int = 1
    ensemble: bool = False
    pre: float = 0.0
    post: float = 1.0
    reloadable: bool = False  # new versions are loaded during the round: c = VERSION_STEP * version
    delay_ms: float = 0.0  # Python: each request sleeps 0..7 times this (calls that outlive deadlines)

    kind = "stateless"

    @property
    def outputs(self) -> list[str]:
        """Y; a Python model also answers RID, each row's request ID (pb_utils request_id())."""
        return ["Y", "RID"] if self.backend == "python" and not self.ensemble else ["Y"]

    def expected(self, x: Array) -> Array:
        out: Array = ((x + np.float32(self.pre)) * np.float32(self.k) + np.float32(self.c)) * np.float32(
            self.post
        )
        return out.astype(np.float32)

    def decode(self, y: Array) -> Array:
        """The X that would give `y` (how a misrouted answer is traced back to its request)."""
        out: Array = (y / np.float32(self.post) - np.float32(self.c)) / np.float32(self.k) - np.float32(
            self.pre
        )
        return out

    def with_version(self, version: int) -> AffineModel:
        return dataclasses.replace(self, c=VERSION_STEP * version)

    def write(self, repo: Path, version: int = 1) -> None:
        if self.ensemble:
            self._write_ensemble(repo, version)
            return
        folder = repo / self.name / str(version)
        folder.mkdir(parents=True, exist_ok=True)
        echo_id = self.outputs != ["Y"]
        if self.backend == "python":
            source = PY_AFFINE.format(
                k=self.k, c=self.c, input="X", output="Y", echo_id=echo_id, delay_ms=self.delay_ms
            )
            (folder / "model.py").write_text(source)
        else:
            build_affine(folder / "model.onnx", self.k, self.c)
        queue = 1024 if self.delay_ms else 0
        config = _stateless_config(
            self.backend, self.instances, self.cached, _io_config("X", "Y", echo_id), queue
        )
        (repo / self.name / "config.pbtxt").write_text(config)

    def _write_ensemble(self, repo: Path, version: int) -> None:
        core = AffineModel(f"{self.name}_core", self.backend, self.c, self.k, instances=self.instances)
        core.write(repo, version)
        steps = []
        for step, (k, c) in (("pre", (1.0, self.pre)), ("post", (self.post, 0.0))):
            name = f"{self.name}_{step}"
            (repo / name / "1").mkdir(parents=True, exist_ok=True)
            source = PY_AFFINE.format(k=k, c=c, input="IN", output="OUT", echo_id=False, delay_ms=0)
            (repo / name / "1" / "model.py").write_text(source)
            (repo / name / "config.pbtxt").write_text(
                _stateless_config("python", 1, False, _io_config("IN", "OUT"))
            )
            steps.append(name)
        step = (
            '{{ model_name: "{model}" model_version: -1 input_map {{ key: "{i}" value: "{src}" }} '
            'output_map {{ key: "{o}" value: "{dst}" }} }}'
        )
        graph = ",\n  ".join(
            [
                step.format(model=steps[0], i="IN", src="X", o="OUT", dst="pre_out"),
                step.format(model=core.name, i="X", src="pre_out", o="Y", dst="core_out"),
                step.format(model=steps[1], i="IN", src="core_out", o="OUT", dst="Y"),
            ]
        )
        (repo / self.name / "1").mkdir(parents=True, exist_ok=True)
        (repo / self.name / "config.pbtxt").write_text(
            f'platform: "ensemble"\nmax_batch_size: 8\n{_io_config("X", "Y")}'
            f"ensemble_scheduling {{ step [\n  {graph}\n] }}\n"
        )


# -- the suite's model sets ---------------------------------------------------------------------------
STATELESS = (
    AffineModel("affine_ort", "onnxruntime", c=1.0, instances=2),
    AffineModel("affine_ov", "openvino", c=2.0),
    AffineModel("affine_py", "python", c=3.0),
    AffineModel("affine_cached", "onnxruntime", c=4.0, cached=True),
    AffineModel("ens_py", "onnxruntime", c=5.0, ensemble=True, pre=10.0, post=2.0),
)

# Calls to it with short client deadlines give up while it sleeps; their late answers must go nowhere.
SLOW = (AffineModel("slow_py", "python", c=6.0, delay_ms=2.0),)

RELOADABLE = (
    AffineModel("reload_ort", "onnxruntime", c=VERSION_STEP, reloadable=True),
    AffineModel("reload_py", "python", c=VERSION_STEP, reloadable=True),
)


@dataclass
class Repository:
    """A model repository folder with the suite's models written into it."""

    root: Path
    stateless: tuple[AffineModel, ...] = ()
    sequences: tuple[SeqModel, ...] = ()
    reloadable: tuple[AffineModel, ...] = ()
    versions: dict[str, int] = field(default_factory=dict)

    def write(self) -> Repository:
        for model in self.stateless:
            model.write(self.root)
        for seq in self.sequences:
            seq.write(self.root)
        for model in self.reloadable:
            model.write(self.root, 1)
            self.versions[model.name] = 1
        return self

    def add_version(self, name: str, on_disk: Callable[[Path], None] | None = None) -> int:
        """Write the next version of reloadable model `name`; returns its number."""
        model = next(m for m in self.reloadable if m.name == name)
        version = self.versions[name] + 1
        model.with_version(version).write(self.root, version)
        if on_disk is not None:
            on_disk(self.root / name)
        self.versions[name] = version
        return version
