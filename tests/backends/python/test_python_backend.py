"""The Python backend on its own: real worker processes, no server. Triton's add_sub, BYTES, errors in
user code, a worker that aborts / exits / hangs, initialize failing, auto_complete_config, close()
leaving no process behind, code sent with a load request refused, pb_utils itself."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pymodels import worker_pids, write_model

from edgeserve.backends.base import BackendOptions, get_backend
from edgeserve.backends.python import pb_utils
from edgeserve.backends.python.backend import PythonBackend, config_dict
from edgeserve.backends.python.instance import PythonInstance
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.config import parse_pbtxt

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def backend() -> PythonBackend:
    found = get_backend("python")
    assert isinstance(found, PythonBackend)
    return found


@pytest.fixture
def load(backend: PythonBackend, tmp_path: Path) -> Iterator[Any]:
    made: list[PythonInstance] = []

    def factory(name: str, options: BackendOptions | None = None) -> PythonInstance:
        path = write_model(tmp_path / "repo", name)
        raw = parse_pbtxt(path.parent.parent / "config.pbtxt")
        _, config = backend.inspect_config(path, raw, "test", BackendOptions())
        if not config.name:
            config.name = name
        instance = backend.load(path, config, options or BackendOptions())
        made.append(instance)
        return instance

    yield factory
    for instance in made:
        instance.close()


def _exited(pid: int) -> bool:
    """Reaped, or a zombie its parent can reap now. Not an empty cmdline: a SIGKILLed process drops
    its memory (and with it the cmdline) before it finishes exiting, and `Popen.poll()` says "still
    running" until it does. Nor a zombie main thread alone: waitpid reports a process only once
    all its threads have exited, which on a busy box comes later."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X") and threads <= 1


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid not in worker_pids() and _exited(pid):
            return True
        time.sleep(0.05)
    return False


def test_add_sub_batch_and_large_tensor(load: Any) -> None:
    instance = load("add_sub")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.full((3, 4), 0.5, dtype=np.float32)
    out = instance.infer({"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    assert out["OUTPUT0"].dtype == np.float32
    # A 600 KB tensor grows the shared memory; a strided input is gathered on the way in.
    big = np.random.default_rng(0).random((8, 37500), dtype=np.float32)  # 1.2 MB per input
    out = instance.infer({"INPUT0": big, "INPUT1": big[:, ::-1]}, outputs=["OUTPUT1"])
    assert list(out) == ["OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT1"], big - big[:, ::-1])
    assert instance.io.inputs[0].shape == (-1, 4)


def test_infer_requests_answers_each_request(load: Any) -> None:
    instance = load("batch_probe")
    batch = [{"X": np.array([[1.0], [2.0]], np.float32)}, {"X": np.array([[-1.0]], np.float32)},
             {"X": np.array([[3.0]], np.float32)}]  # fmt: skip
    first, second, third = instance.infer_requests(batch)
    assert isinstance(first, dict) and isinstance(third, dict)
    assert first["N"].tolist() == [[3], [3]] and first["ROWS"].tolist() == [[2], [2]]
    assert first["Y"].tolist() == [[10.0], [20.0]] and third["Y"].tolist() == [[30.0]]
    assert isinstance(second, InferenceError) and second.status is Status.INVALID_ARG
    assert second.message == "negative X"


def test_bytes_in_and_out(load: Any) -> None:
    instance = load("strings")
    text = np.array([b"hello", b"", "ed\u00e9".encode(), b"x" * 1000], dtype=np.object_)
    out = instance.infer({"TEXT": text})
    assert list(out["UPPER"]) == [
        b"HELLO",
        b"",
        "ED\u00e9".encode(),
        b"X" * 1000,
    ]  # bytes.upper(): ASCII only
    assert out["LENGTH"].tolist() == [5, 0, 4, 1000]


def _faulty(instance: PythonInstance, mode: int) -> dict[str, Any]:
    x = np.array([1.5, -2.0], dtype=np.float32)
    return instance.infer({"X": x, "MODE": np.array([mode], dtype=np.int32)})


def test_errors_in_user_code_fail_one_call_only(load: Any) -> None:
    instance = load("faulty")
    pid = instance.pid
    with pytest.raises(InferenceError) as raised:
        _faulty(instance, 1)
    assert raised.value.status is Status.INTERNAL
    assert "ValueError: mode 1 asks for an exception (call 1)" in raised.value.message
    assert "model.py:" in raised.value.message and "in execute" in raised.value.message
    with pytest.raises(InferenceError) as raised:
        _faulty(instance, 2)
    assert raised.value.status is Status.INTERNAL and raised.value.message == "mode 2 refused"
    assert _faulty(instance, 0)["Y"].tolist() == [3.0, -4.0]
    assert instance.pid == pid and instance.restarts == 0  # the same worker lived through it


@pytest.mark.parametrize(
    ("mode", "how"), [(3, "was killed by SIGABRT (signal 6)"), (5, "exited with code 3")]
)
def test_a_dying_worker_fails_its_call_and_is_restarted(load: Any, mode: int, how: str) -> None:
    instance = load("faulty")
    old = instance.pid
    assert old is not None
    with pytest.raises(InferenceError) as raised:
        _faulty(instance, mode)
    error = raised.value
    assert error.status is Status.INTERNAL
    assert "model 'faulty' version 1 instance" in error.message
    assert f"(pid {old}) {how} while executing the request; restarting it" in error.message
    assert _gone(old)
    assert _faulty(instance, 0)["Y"].tolist() == [3.0, -4.0]  # waits for the restart
    assert instance.restarts == 1 and instance.pid not in (None, old)


def test_a_hanging_call_is_cut_off_and_the_worker_replaced(load: Any) -> None:
    # hang_timeout_s 0.2 in the options: the instance kills its worker at 0.2 s + the grace.
    instance = load("faulty", BackendOptions(parameters={"hang_timeout_s": "0.2"}))
    old = instance.pid
    assert old is not None
    with pytest.raises(InferenceError) as raised:
        _faulty(instance, 4)
    assert raised.value.status is Status.UNAVAILABLE
    assert f"did not return in 2.2 s; the Python worker (pid {old}) was killed" in raised.value.message
    assert _gone(old)
    assert _faulty(instance, 0)["Y"].tolist() == [3.0, -4.0]
    assert instance.pid != old


def test_close_kills_a_worker_stuck_in_a_call(load: Any) -> None:
    import threading

    instance = load("faulty", BackendOptions(parameters={"hang_timeout_s": "0"}))  # never cut off
    pid = instance.pid
    assert pid is not None
    errors: list[BaseException] = []

    def call() -> None:
        try:
            _faulty(instance, 4)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)
    instance.close()  # the call is in flight: SIGTERM at once, SIGKILL after a second
    thread.join(10)
    assert not thread.is_alive() and _gone(pid)
    assert isinstance(errors[0], InferenceError) and errors[0].status is Status.UNAVAILABLE
    assert "closed" in errors[0].message


def test_close_runs_finalize_and_reaps(load: Any, capfd: pytest.CaptureFixture[str]) -> None:
    instance = load("add_sub")
    pid = instance.pid
    assert pid is not None and pid in worker_pids(os.getpid())
    instance.close()
    assert _gone(pid) and pid not in worker_pids()
    assert "Cleaning up..." in capfd.readouterr().out  # finalize() ran
    with pytest.raises(InferenceError) as raised:
        instance.infer({"INPUT0": np.zeros((1, 4), np.float32), "INPUT1": np.zeros((1, 4), np.float32)})
    assert raised.value.status is Status.UNAVAILABLE


def test_initialize_failure_fails_the_load(backend: PythonBackend, tmp_path: Path) -> None:
    path = write_model(tmp_path / "repo", "broken_init")
    config = parse_pbtxt(path.parent.parent / "config.pbtxt")
    config.name = "broken_init"
    before = set(worker_pids(os.getpid()))
    with pytest.raises(InferenceError) as raised:
        backend.load(path, config, BackendOptions())
    message = raised.value.message
    assert raised.value.status is Status.INVALID_ARG
    assert (
        "initialize() failed: RuntimeError: no weights in broken_init (model.py:7 in initialize)" in message
    )
    assert set(worker_pids(os.getpid())) <= before


def test_import_errors_name_the_line(backend: PythonBackend, tmp_path: Path) -> None:
    path = write_model(tmp_path / "repo", "syntax", "def broken(:\n", 'backend: "python"\n')
    raw = parse_pbtxt(path.parent.parent / "config.pbtxt")
    raw.input.add(name="X", data_type=11, dims=[1])  # TYPE_FP32
    raw.output.add(name="Y", data_type=11, dims=[1])
    with pytest.raises(InferenceError) as raised:
        backend.load(path, raw, BackendOptions())
    assert "import failed: SyntaxError" in raised.value.message


def test_auto_complete_config_runs_in_a_worker(backend: PythonBackend, tmp_path: Path) -> None:
    path = write_model(tmp_path / "repo", "auto")
    raw = parse_pbtxt(path.parent.parent / "config.pbtxt")
    before = set(worker_pids(os.getpid()))
    io, config = backend.inspect_config(path, raw, "auto/config.pbtxt", BackendOptions())
    assert config.max_batch_size == 2 and config.HasField("dynamic_batching")
    assert [(t.name, t.datatype, t.shape) for t in io.inputs] == [("IN", "FP32", (-1, 3))]
    assert [t.name for t in io.outputs] == ["OUT"]
    assert set(worker_pids(os.getpid())) <= before  # the auto-complete worker is gone
    config.name = "auto"
    instance = backend.load(path, config, BackendOptions())
    try:
        out = instance.infer({"IN": np.zeros((2, 3), np.float32)})
        assert out["OUT"].tolist() == [[1.0] * 3] * 2
    finally:
        instance.close()


def test_no_declared_tensors_is_a_clear_error(backend: PythonBackend, tmp_path: Path) -> None:
    path = write_model(
        tmp_path / "repo", "bare", "class TritonPythonModel:\n    pass\n", 'backend: "python"\n'
    )
    with pytest.raises(InferenceError) as raised:
        backend.inspect_config(path, parse_pbtxt(path.parent.parent / "config.pbtxt"), "bare/config.pbtxt")
    assert raised.value.status is Status.INVALID_ARG
    assert "declares its inputs in config.pbtxt" in raised.value.message


def test_code_sent_with_a_load_request_is_refused(backend: PythonBackend, tmp_path: Path) -> None:
    """Decided by the options the repository sets from the load's origin, at any folder depth."""
    path = write_model(tmp_path / "override", "add_sub")
    deeper = path.parent / "x" / "model.py"  # default_model_filename: "x/model.py"
    deeper.parent.mkdir()
    deeper.write_text(path.read_text())
    config = parse_pbtxt(path.parent.parent / "config.pbtxt")
    before = set(worker_pids(os.getpid()))
    for model_file in (path, deeper):
        with pytest.raises(InferenceError) as raised:
            backend.load(model_file, config, BackendOptions(from_load_request=True))
        assert raised.value.status is Status.PERMISSION_DENIED
        assert "only from the local model repository or a signed bundle" in raised.value.message
    assert set(worker_pids(os.getpid())) <= before  # no worker was started


def test_auto_complete_code_runs_only_with_a_known_origin(backend: PythonBackend, tmp_path: Path) -> None:
    path = write_model(tmp_path / "repo", "auto")
    raw = parse_pbtxt(path.parent.parent / "config.pbtxt")
    for options in (None, BackendOptions(from_load_request=True)):
        with pytest.raises(InferenceError) as raised:
            backend.inspect_config(path, raw, "auto/config.pbtxt", options)
        assert raised.value.status is Status.PERMISSION_DENIED


def test_model_config_arg_is_tritons_json(tmp_path: Path) -> None:
    config = parse_pbtxt(write_model(tmp_path / "repo", "add_sub").parent.parent / "config.pbtxt")
    data = config_dict(config)
    json.dumps(data)
    assert data["max_batch_size"] == 8 and data["input"][0]["dims"] == [4]
    assert data["output"][1]["data_type"] == "TYPE_FP32"
    assert data["dynamic_batching"]["max_queue_delay_microseconds"] == 20000
    assert pb_utils.get_output_config_by_name(data, "OUTPUT1")["name"] == "OUTPUT1"
    assert pb_utils.get_input_config_by_name(json.dumps(data), "nope") is None


def test_pb_utils_surface() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    tensor = pb_utils.Tensor("T", np.array(["a", "b"]))
    assert tensor.name() == "T" and tensor.as_numpy().dtype == np.object_
    request = pb_utils.InferenceRequest(inputs=[tensor], requested_output_names=["OUT"], request_id="id-1")
    assert pb_utils.get_input_tensor_by_name(request, "T") is tensor
    assert pb_utils.get_input_tensor_by_name(request, "U") is None
    assert request.request_id() == "id-1" and json.loads(request.parameters()) == {}
    response = pb_utils.InferenceResponse(error=pb_utils.TritonError("no", pb_utils.TritonError.INVALID_ARG))
    assert response.has_error() and response.error() is not None
    assert response.error().message() == "no" and response.error().code() == pb_utils.TritonError.INVALID_ARG
    auto = pb_utils.ModelConfig(
        {"name": "m", "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": [2]}]}
    )
    auto.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [2]})  # the same again: fine
    with pytest.raises(ValueError):
        auto.add_input({"name": "A", "data_type": "TYPE_INT8", "dims": [2]})
    auto.set_max_batch_size(4)
    with pytest.raises(ValueError):
        auto.set_max_batch_size(2)
    assert auto.as_dict()["max_batch_size"] == 4 and len(auto.as_dict()["input"]) == 1


def test_pb_utils_logger_writes_one_line_per_call_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    pb_utils.Logger.log("plain")
    pb_utils.Logger.log_info("i")
    pb_utils.Logger.log_warn("w")
    pb_utils.Logger.log_error(message="e")
    pb_utils.Logger.log_verbose("v")
    pb_utils.Logger.log("x", pb_utils.Logger.ERROR)
    assert capsys.readouterr().err.splitlines() == [
        "[python model] INFO: plain",
        "[python model] INFO: i",
        "[python model] WARNING: w",
        "[python model] ERROR: e",
        "[python model] VERBOSE: v",
        "[python model] ERROR: x",
    ]


def test_an_output_of_the_wrong_type_is_a_clear_error(backend: PythonBackend, tmp_path: Path) -> None:
    """A float for an integer output is refused; a number of the same kind (an INT64 sum for an INT32
    output, as Triton's bls_decoupled example) is taken and cast by the server
    (test_triton_example_patterns)."""
    source = (
        "import numpy as np\nimport triton_python_backend_utils as pb_utils\n\n\n"
        "class TritonPythonModel:\n    def execute(self, requests):\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', np.zeros(1))]) for r in requests]\n"
    )
    config_text = (
        'backend: "python"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }]\n'
    )
    path = write_model(tmp_path / "repo", "float64", source, config_text)
    config = parse_pbtxt(path.parent.parent / "config.pbtxt")
    instance = backend.load(path, config, BackendOptions())
    try:
        with pytest.raises(InferenceError) as raised:
            instance.infer({"X": np.zeros(1, np.float32)})
        assert "returned output 'Y' as FP64, but the config declares INT32" in raised.value.message
    finally:
        instance.close()


def test_decoupled_models_are_accepted(backend: PythonBackend, tmp_path: Path) -> None:
    """model_transaction_policy { decoupled: true } loads (issue 35; test_python_decoupled.py runs them)."""
    config_text = (
        'backend: "python"\nmodel_transaction_policy { decoupled: true }\n'
        'input [{ name: "IN" data_type: TYPE_INT32 dims: [1] }]\n'
        'output [{ name: "OUT" data_type: TYPE_INT32 dims: [1] }]\n'
    )
    path = write_model(tmp_path / "repo", "decoupled", "class TritonPythonModel:\n    pass\n", config_text)
    _, config = backend.inspect_config(path, parse_pbtxt(path.parent.parent / "config.pbtxt"), "decoupled")
    assert config.model_transaction_policy.decoupled


def test_a_worker_killed_while_idle_is_replaced_by_the_next_call(load: Any) -> None:
    import signal

    instance = load("faulty")
    old = instance.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)  # the OOM killer, say
    assert _gone(old)
    assert _faulty(instance, 0)["Y"].tolist() == [3.0, -4.0]
    assert instance.restarts == 1 and instance.pid not in (None, old)


def test_closing_the_scheduler_of_a_hung_model_kills_its_worker(load: Any) -> None:
    """hang_timeout_s 0 (no hang detector): an unload still ends the stuck call and the worker."""
    from edgeserve.scheduling.job import Job
    from edgeserve.scheduling.scheduler import Scheduler
    from edgeserve.scheduling.stats import ModelStats

    instance = load("faulty", BackendOptions(parameters={"hang_timeout_s": "0"}))
    pid = instance.pid
    assert pid is not None
    config = parse_pbtxt(Path(instance.spec.model_file).parent.parent / "config.pbtxt")
    scheduler = Scheduler("faulty", 1, config, [instance], ModelStats("faulty", 1), hang_timeout_s=0)
    scheduler.start()
    answers: list[Any] = []
    inputs = {"X": np.zeros(2, np.float32), "MODE": np.array([4], np.int32)}
    scheduler.submit(Job(inputs, 1, answers.append))
    time.sleep(0.5)
    scheduler.close(join_timeout_s=0.5)
    assert _gone(pid)
    deadline = time.monotonic() + 10
    while not answers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(answers[0], InferenceError) and answers[0].status is Status.UNAVAILABLE
