"""Reused gather buffers for dynamic batches (scheduling/buffers.py): a batch is gathered into a pooled
buffer, the buffer serves the next batch only once the runtime is done with it and no output is a view
of it, and the pool stays within its bounds. The scheduler tests run the product's ONNX Runtime backend
on a real model; a gate holds the worker so each batch's content is known exactly."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sched_helpers import WAIT_S, GatedInstance, hold_worker, make_config, mlp_input, submit_all

from edgeserve.scheduling.buffers import BatchBuffers
from edgeserve.scheduling.scheduler import Scheduler
from edgeserve.scheduling.stats import ModelStats

BATCHING_8 = "max_batch_size: 8\ndynamic_batching { }\n"


def _rows(count: int, seed: int) -> list[dict[str, np.ndarray]]:
    return [mlp_input(seed=seed + i) for i in range(count)]


def test_gather_concatenates_into_a_buffer_reused_by_the_next_batch():
    pool = BatchBuffers(max_rows=8)
    batch = _rows(3, 0)
    gathered, lease = pool.gather(batch)
    np.testing.assert_array_equal(gathered["INPUT0"], np.concatenate([b["INPUT0"] for b in batch]))
    first = gathered["INPUT0"]
    pool.release(lease, {"OUTPUT0": np.zeros((3, 4), np.float32)})  # a runtime's own output
    assert pool.pooled == (1, 8 * 16 * 4)  # max_rows rows: any batch up to 8 fits it

    batch = _rows(5, 10)
    again, _ = pool.gather(batch)
    np.testing.assert_array_equal(again["INPUT0"], np.concatenate([b["INPUT0"] for b in batch]))
    assert np.shares_memory(again["INPUT0"], first)  # the same pages, written once more
    assert (pool.allocated, pool.reused) == (1, 1)
    assert again["INPUT0"].flags.c_contiguous


def test_one_job_is_passed_as_it_is():
    pool = BatchBuffers(max_rows=8)
    inputs = mlp_input(rows=2)
    gathered, lease = pool.gather([inputs])
    assert gathered is inputs and lease is None
    assert pool.allocated == 0


def test_a_buffer_an_output_views_is_left_to_the_clients():
    pool = BatchBuffers(max_rows=8)
    gathered, lease = pool.gather(_rows(2, 0))
    pool.release(lease, {"OUTPUT0": gathered["INPUT0"][:, :4]})  # e.g. a model handing back its input
    assert pool.pooled == (0, 0)
    gathered, lease = pool.gather(_rows(2, 0))
    pool.release(lease, {"OUTPUT0": [1, 2]})  # not an array: nothing known about it, not reused
    assert pool.pooled == (0, 0)


def test_the_pool_is_bounded_in_buffers_and_bytes_and_cleared():
    by_count = BatchBuffers(max_rows=8, max_buffers=2)
    leases = [by_count.gather(_rows(2, i))[1] for i in range(3)]  # three batches in flight at once
    for lease in leases:
        by_count.release(lease, {})
    assert by_count.pooled[0] == 2
    by_count.clear()
    assert by_count.pooled == (0, 0)

    by_bytes = BatchBuffers(max_rows=8, max_bytes=8 * 16 * 4 + 1)  # room for one buffer
    leases = [by_bytes.gather(_rows(2, i))[1] for i in range(2)]
    for lease in leases:
        by_bytes.release(lease, {})
    assert by_bytes.pooled == (1, 8 * 16 * 4)


def test_a_larger_batch_than_max_rows_gets_its_own_buffer():
    pool = BatchBuffers(max_rows=2)
    gathered, lease = pool.gather(_rows(3, 0))
    assert gathered["INPUT0"].shape == (3, 16)
    pool.release(lease, {})
    small, _ = pool.gather(_rows(2, 0))  # the 3-row buffer serves a 2-row batch too
    assert small["INPUT0"].shape == (2, 16) and pool.reused == 1


def test_strings_and_mixed_dtypes_are_concatenated_as_before():
    pool = BatchBuffers(max_rows=8)
    texts = [{"T": np.array([b"a"], dtype=object)}, {"T": np.array([b"bc"], dtype=object)}]
    gathered, lease = pool.gather(texts)
    assert list(gathered["T"]) == [b"a", b"bc"]
    assert lease is not None and lease.buffers == []


def _batch(scheduler: Scheduler, instance: Any, seed: int) -> list[tuple[Any, Any]]:
    """Hold the worker on one job, queue four more behind it (one batch of four), let it run."""
    held = hold_worker(scheduler, instance, mlp_input(seed=seed + 100))
    jobs = submit_all(scheduler, _rows(4, seed))
    instance.gate.set()
    instance.wait_entered()  # the batch of four
    assert scheduler.wait_idle(WAIT_S)
    instance.gate.clear()
    return [held, *jobs]


def test_two_batches_in_a_row_each_client_gets_its_own_answer(make_scheduler, reference):
    """The second batch is gathered into the first batch's buffer: the first batch's clients still
    hold their own (correct) rows, because the runtime's outputs never alias the input buffer."""
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8, open_gate=False)
    first = _batch(scheduler, instance, seed=0)
    second = _batch(scheduler, instance, seed=50)
    assert [call["INPUT0"].shape for call in instance.calls] == [(1, 16), (4, 16), (1, 16), (4, 16)]
    assert np.shares_memory(instance.calls[1]["INPUT0"], instance.calls[3]["INPUT0"])  # reused
    for job, result in first + second:
        expected = reference("mlp", job.inputs)["OUTPUT0"]
        np.testing.assert_allclose(result.outputs()["OUTPUT0"], expected, rtol=1e-5, atol=1e-6)


class InputEcho:
    """A real instance (no runtime) whose output is a view of its input, as a Python model may return."""

    def __init__(self) -> None:
        self.io = None
        self.closed = False

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, Any]:
        return {"OUTPUT0": inputs["INPUT0"]}

    def close(self) -> None:
        self.closed = True


def test_outputs_that_view_the_batch_keep_their_rows_after_the_next_batch():
    config = make_config('name: "echo"\n' + BATCHING_8)
    instance = GatedInstance(InputEcho(), open_gate=False)
    scheduler = Scheduler("echo", 1, config, [instance], ModelStats("echo", 1))
    scheduler.start()
    try:
        first = _batch(scheduler, instance, seed=0)
        second = _batch(scheduler, instance, seed=50)
        assert not np.shares_memory(instance.calls[1]["INPUT0"], instance.calls[3]["INPUT0"])
        for job, result in first + second:
            np.testing.assert_array_equal(result.outputs()["OUTPUT0"], job.inputs["INPUT0"])
    finally:
        instance.gate.set()
        scheduler.close()
