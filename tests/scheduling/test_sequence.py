"""Sequence batcher unit tests on the real accumulate model (ONNX Runtime) and on a recording fake:
state kept per sequence, Direct slots and padding, Oldest batching, START/END/idle rules, backlog."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sched_helpers import GatedInstance, GatedSchedulers, Result, load_instance, make_config

from edgeserve.backends.base import ModelIO, TensorSpec
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.samples import build_accumulate
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.sequence import SequenceBatcher
from edgeserve.scheduling.stats import ModelStats, batch_sizes

CONTROLS = """
  control_input [
    { name: "START", control [ { kind: CONTROL_SEQUENCE_START, fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY", control [ { kind: CONTROL_SEQUENCE_READY, fp32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "STATE_IN", output_name: "STATE_OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


def accumulate_config(strategy: str = "direct { }", max_batch: int = 4, idle_us: int = 0) -> str:
    return (
        f'name: "accumulate"\nmax_batch_size: {max_batch}\n'
        'input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        f"sequence_batching {{\n max_sequence_idle_microseconds: {idle_us}\n{CONTROLS}\n {strategy}\n}}\n"
    )


@pytest.fixture(scope="module")
def accumulate_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_accumulate(tmp_path_factory.mktemp("seq") / "accumulate.onnx")


@pytest.fixture
def make_batcher(accumulate_path: Path) -> Iterator[Any]:
    batchers = GatedSchedulers(SequenceBatcher)

    def factory(config_text: str, instances: int = 1, open_gate: bool = True, **kwargs: Any) -> Any:
        return batchers.start("accumulate", accumulate_path, make_config(config_text), instances, open_gate,
                              **kwargs)  # fmt: skip

    yield factory
    batchers.close()


def step(batcher: Any, seq: int | str, value: float, start: bool = False, end: bool = False) -> Result:
    result = Result()
    params = {"sequence_id": seq, "sequence_start": start, "sequence_end": end}
    inputs = {"INPUT": np.full((1, 1), value, np.float32)}
    job = Job(inputs=inputs, batch_size=1, done=result, parameters=params)
    batcher.submit(job)
    return result


def total(result: Result) -> float:
    return float(result.outputs()["OUTPUT"][0, 0])


def test_states_are_kept_apart_and_start_resets(make_batcher: Any) -> None:
    batcher, _ = make_batcher(accumulate_config())
    assert total(step(batcher, 1, 1.0, start=True)) == 1.0
    assert total(step(batcher, "b", 10.0, start=True)) == 10.0
    assert total(step(batcher, 1, 2.0)) == 3.0
    assert total(step(batcher, "b", 5.0)) == 15.0
    assert total(step(batcher, 1, 4.0, start=True)) == 4.0  # START again: a fresh state
    assert total(step(batcher, 1, 1.0, end=True)) == 5.0
    assert total(step(batcher, "b", 1.0)) == 16.0


def test_start_rules(make_batcher: Any) -> None:
    batcher, _ = make_batcher(accumulate_config())
    with pytest.raises(InferenceError) as err:
        step(batcher, 99, 1.0)
    assert err.value.status is Status.INVALID_ARG
    assert err.value.message == (
        "inference request for sequence 99 to model 'accumulate' must specify the START flag on the first "
        "request of the sequence"
    )
    for bad in (0, ""):
        with pytest.raises(InferenceError, match="non-zero or non-empty correlation ID"):
            step(batcher, bad, 1.0, start=True)
    assert total(step(batcher, 5, 1.0, start=True, end=True)) == 1.0  # a one-request sequence
    with pytest.raises(InferenceError, match="START flag"):
        step(batcher, 5, 1.0)  # ended
    assert batcher.stats.to_dict()["inference_stats"]["fail"]["count"] == 4


def test_end_frees_the_slot_for_the_backlog(make_batcher: Any) -> None:
    batcher, _ = make_batcher(accumulate_config(max_batch=2))  # 2 slots
    assert total(step(batcher, 1, 1.0, start=True)) == 1.0
    assert total(step(batcher, 2, 2.0, start=True)) == 2.0
    waiting = step(batcher, 3, 3.0, start=True)  # no slot: it waits in the backlog
    assert batcher.backlog == 1 and not waiting._event.wait(0.2)
    assert total(step(batcher, 1, 1.0, end=True)) == 2.0
    assert total(waiting) == 3.0  # took sequence 1's slot
    assert batcher.active_sequences == 2 and batcher.backlog == 0
    assert total(step(batcher, 3, 1.0)) == 4.0


def test_backlog_bound(make_batcher: Any) -> None:
    batcher, _ = make_batcher(accumulate_config(max_batch=1), max_backlog=1)
    step(batcher, 1, 1.0, start=True).get()
    step(batcher, 2, 1.0, start=True)
    with pytest.raises(InferenceError) as err:
        step(batcher, 3, 1.0, start=True)
    assert err.value.status is Status.UNAVAILABLE and "every sequence slot is taken" in err.value.message


def test_idle_timeout_frees_the_slot(make_batcher: Any) -> None:
    batcher, _ = make_batcher(accumulate_config(max_batch=1, idle_us=100_000))
    assert total(step(batcher, 1, 1.0, start=True)) == 1.0
    waiting = step(batcher, 2, 5.0, start=True)  # the only slot is held by sequence 1
    assert total(waiting) == 5.0  # sequence 1 idles out after 0.1 s; sequence 2 takes its slot
    with pytest.raises(InferenceError) as err:
        step(batcher, 1, 1.0)
    assert "START flag" in err.value.message
    assert "idle longer than max_sequence_idle_microseconds" in err.value.message
    assert total(step(batcher, 2, 1.0)) == 6.0


def test_direct_pads_empty_slots_with_ready_zero(make_batcher: Any) -> None:
    batcher, gated = make_batcher(accumulate_config(max_batch=4))
    for seq in (1, 2, 3):
        step(batcher, seq, float(seq), start=True).get()
    step(batcher, 1, 1.0, end=True).get()  # frees slot 0
    result = step(batcher, 3, 10.0)  # slot 2: rows 0..2, rows 0 and 1 empty
    assert total(result) == 13.0
    call = gated[0].calls[-1]
    assert call["READY"].ravel().tolist() == [0.0, 0.0, 1.0]
    assert call["INPUT"].ravel().tolist() == [0.0, 0.0, 10.0]
    assert call["STATE_IN"].ravel().tolist() == [0.0, 0.0, 3.0]


def test_oldest_batches_several_sequences(make_batcher: Any) -> None:
    strategy = "oldest { max_candidate_sequences: 8, preferred_batch_size: [ 4 ], "
    strategy += "max_queue_delay_microseconds: 200000 }"
    batcher, _ = make_batcher(accumulate_config(strategy, max_batch=4))
    results = [step(batcher, seq, float(seq), start=True) for seq in range(1, 5)]
    assert [total(r) for r in results] == [1.0, 2.0, 3.0, 4.0]
    assert batch_sizes(batcher.stats.to_dict()) == {4: 1}
    more = [step(batcher, seq, 1.0) for seq in range(1, 5)]
    assert [total(r) for r in more] == [2.0, 3.0, 4.0, 5.0]
    assert batch_sizes(batcher.stats.to_dict()) == {4: 2}


def test_interleaved_threads_keep_their_sums(make_batcher: Any) -> None:
    batcher, _ = make_batcher(accumulate_config(max_batch=4), instances=2)  # 8 slots, 16 sequences
    errors: list[str] = []

    def client(seq: int) -> None:
        running = 0.0
        for n in range(20):
            value = float(seq * 100 + n)
            running += value
            try:
                got = total(step(batcher, seq, value, start=n == 0, end=n == 19))
            except Exception as exc:
                errors.append(f"{seq}: {exc}")
                return
            if got != running:
                errors.append(f"sequence {seq} step {n}: {got} != {running}")

    threads = [threading.Thread(target=client, args=(s,)) for s in range(1, 17)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert batcher.active_sequences == 0 and batcher.wait_idle(5)


class Recorder:
    """Echoes STATE_IN + INPUT; remembers every call's inputs (the controls included)."""

    def __init__(self, batched: bool) -> None:
        self.calls: list[dict[str, np.ndarray]] = []
        shape = (-1, 1) if batched else (1,)
        spec = TensorSpec("INPUT", "FP32", shape)
        self.io = ModelIO((spec,), (TensorSpec("OUTPUT", "FP32", shape),))

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, Any]:
        self.calls.append({k: np.array(v) for k, v in inputs.items()})
        value = inputs["INPUT"] + inputs["STATE_IN"]
        return {"OUTPUT": value, "STATE_OUT": value}

    def close(self) -> None:
        pass


def test_control_values_corrid_end_and_no_batching() -> None:
    config = make_config(
        'name: "rec"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        "sequence_batching {\n control_input [\n"
        ' { name: "S", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] },\n'
        ' { name: "E", control [ { kind: CONTROL_SEQUENCE_END, bool_false_true: [ false, true ] } ] },\n'
        ' { name: "C", control [ { kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64 } ] }\n ]\n'
        ' state [ { input_name: "STATE_IN", output_name: "STATE_OUT", data_type: TYPE_FP32, dims: [ 1 ]\n'
        '   initial_state [ { data_type: TYPE_FP32, dims: [ 1 ], zero_data: true, name: "z" } ] } ]\n}\n'
    )
    recorder = Recorder(batched=False)
    batcher = SequenceBatcher("rec", 1, config, [recorder], ModelStats("rec", 1))
    batcher.start()
    try:
        for n, value in enumerate((1.0, 2.0, 3.0)):
            result = Result()
            params = {"sequence_id": 2**63 + 5, "sequence_start": n == 0, "sequence_end": n == 2}
            batcher.submit(Job(inputs={"INPUT": np.array([value], np.float32)}, batch_size=1, done=result,
                               parameters=params))  # fmt: skip
            assert result.outputs()["OUTPUT"].tolist() == [sum((1.0, 2.0, 3.0)[: n + 1])]
        first, last = recorder.calls[0], recorder.calls[-1]
        assert first["S"].tolist() == [1] and first["S"].dtype == np.int32 and first["E"].tolist() == [False]
        assert last["S"].tolist() == [0] and last["E"].tolist() == [True]
        assert first["C"].dtype == np.uint64 and first["C"].tolist() == [2**63 + 5]
        assert last["STATE_IN"].tolist() == [3.0]
        assert batcher.active_sequences == 0  # END released it
    finally:
        batcher.close()


def test_close_fails_what_is_queued(make_batcher: Any) -> None:
    batcher, gated = make_batcher(accumulate_config(max_batch=1), open_gate=False)
    running = step(batcher, 1, 1.0, start=True)
    gated[0].wait_entered()
    queued = step(batcher, 1, 1.0)
    closer = threading.Thread(target=batcher.close)
    closer.start()
    deadline = time.monotonic() + 60  # generous: waits on close failing it, not on this box's speed
    while not queued.calls and time.monotonic() < deadline:  # failed at once, while the batch still runs
        time.sleep(0.01)
    gated[0].gate.set()
    closer.join(10)
    assert total(running) == 1.0
    error = queued.error()
    assert isinstance(error, InferenceError) and error.status is Status.UNAVAILABLE


def test_drain_runs_the_backlog_and_refuses_new_requests(make_batcher: Any) -> None:
    import asyncio

    batcher, _ = make_batcher(accumulate_config(max_batch=1, idle_us=60_000_000))
    assert total(step(batcher, 1, 1.0, start=True)) == 1.0
    waiting = step(batcher, 2, 2.0, start=True)  # backlog: sequence 1 holds the only slot for a minute
    assert asyncio.run(batcher.drain(10.0))
    assert total(waiting) == 2.0  # draining freed the idle slot for it
    with pytest.raises(InferenceError) as err:
        step(batcher, 3, 1.0, start=True)
    assert err.value.status is Status.UNAVAILABLE
    stats = batcher.stats.to_dict()
    assert (
        stats["inference_stats"]["success"]["count"] == 2 and stats["inference_stats"]["fail"]["count"] == 1
    )


def test_direct_waits_for_minimum_slot_utilization(make_batcher: Any) -> None:
    # A 10-minute delay: only the second sequence can end the wait, however slowly this box runs the test.
    strategy = "direct { max_queue_delay_microseconds: 600000000 minimum_slot_utilization: 0.5 }"
    batcher, gated = make_batcher(accumulate_config(strategy, max_batch=4))
    first = step(batcher, 1, 1.0, start=True)
    assert not first._event.wait(0.2)  # 1 of 4 slots ready: waits for a second one
    second = step(batcher, 2, 2.0, start=True)
    assert total(first) == 1.0 and total(second) == 2.0
    assert len(gated[0].calls) == 1 and gated[0].calls[0]["READY"].ravel().tolist() == [1.0, 1.0]


def test_a_hung_instance_is_answered_and_replaced(make_batcher: Any, accumulate_path: Path) -> None:
    config = make_config(accumulate_config(max_batch=2))
    fresh: list[GatedInstance] = []

    def factory() -> GatedInstance:
        fresh.append(GatedInstance(load_instance(accumulate_path, config)))
        return fresh[-1]

    # An hour's hang timeout, checked with the clock the test wants (check_hung): a real run on the
    # replacement can never be taken for a hang, however slow this box is.
    batcher, gated = make_batcher(accumulate_config(max_batch=2), open_gate=False, hang_timeout_s=3600.0,
                                  instance_factory=factory)  # fmt: skip
    hung = step(batcher, 2, 1.0, start=True)
    gated[0].wait_entered()
    started = time.monotonic_ns()
    batcher.check_hung(started + int(1800e9))  # not yet
    assert hung.calls == 0 and batcher.replaced == 0
    batcher.check_hung(started + int(3601e9))  # past the hang timeout (whenever the batch began)
    error = hung.error()
    assert isinstance(error, InferenceError) and error.status is Status.UNAVAILABLE
    assert "did not answer in 3600 s" in error.message and "must start again" in error.message
    with pytest.raises(InferenceError, match="START flag"):
        step(batcher, 2, 1.0)  # its state went with the instance
    assert total(step(batcher, 2, 7.0, start=True)) == 7.0  # on the replacement
    assert batcher.replaced == 1 and len(fresh) == 1
    gated[0].gate.set()  # the hung call returns at last: dropped, the old instance closed
    deadline = time.monotonic() + 60
    while not gated[0].closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gated[0].closed and hung.calls == 1
    stats = batcher.stats.to_dict()["inference_stats"]
    assert stats["fail"]["count"] == 2 and stats["success"]["count"] == 1
