"""Dynamic batching with a real onnxruntime model: batches form, shapes never mix, outputs go back to
the right request as views, and jobs run alone where the model does not batch.

Queueing is made deterministic with a gate that holds the (single) worker inside infer() while the
test fills the queue; nothing here sleeps to synchronise or asserts on timing."""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import numpy as np
from sched_helpers import WAIT_S, Result, hold_worker, make_job, mlp_input, submit_all

from edgeserve.scheduling.job import Job
from edgeserve.scheduling.stats import batch_sizes

BATCHING_8 = "max_batch_size: 8\ndynamic_batching { }\n"
BATCHING_4 = "max_batch_size: 4\ndynamic_batching { }\n"


def _assert_mlp_answers(jobs: list[tuple[Job, Result]], reference: Any) -> None:
    for job, result in jobs:
        expected = reference("mlp", job.inputs)["OUTPUT0"]
        np.testing.assert_allclose(result.outputs()["OUTPUT0"], expected, rtol=1e-5)


def test_batches_form_behind_a_busy_worker(make_scheduler, reference):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8, open_gate=False)
    first, first_result = hold_worker(scheduler, instance, mlp_input(seed=100))
    jobs = submit_all(scheduler, [mlp_input(seed=i) for i in range(8)])
    assert scheduler.pending_count == 8
    instance.gate.set()

    np.testing.assert_allclose(first_result.outputs()["OUTPUT0"], reference("mlp", first.inputs)["OUTPUT0"])
    for job, result in jobs:
        expected = reference("mlp", job.inputs)["OUTPUT0"]
        np.testing.assert_allclose(result.outputs()["OUTPUT0"], expected, rtol=1e-5, atol=1e-6)
        assert result.calls == 1
        assert result.thread.startswith("edgeserve-mlp-v1-")  # delivered on the worker thread
    assert scheduler.wait_idle(WAIT_S)
    assert [call["INPUT0"].shape for call in instance.calls] == [(1, 16), (8, 16)]
    stats = scheduler.stats.to_dict()
    assert batch_sizes(stats) == {1: 1, 8: 1}
    assert stats["inference_count"] == 9
    assert stats["execution_count"] == 2
    assert stats["inference_stats"]["success"]["count"] == 9
    assert stats["inference_stats"]["queue"]["count"] == 9
    assert stats["last_inference"] > 0
    assert scheduler.pending_count == 0


def test_max_batch_size_caps_rows_and_order_is_kept(make_scheduler, reference):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_4, open_gate=False)
    hold_worker(scheduler, instance, mlp_input(seed=99))
    jobs = submit_all(scheduler, [mlp_input(fill=float(i)) for i in range(10)])
    instance.gate.set()
    _assert_mlp_answers(jobs, reference)
    assert scheduler.wait_idle(WAIT_S)
    # batches of 4, 4, 2 rows, each taking the queue in arrival order
    assert [c["INPUT0"][:, 0].tolist() for c in instance.seen[1:]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batch_sizes(scheduler.stats.to_dict()) == {1: 1, 4: 2, 2: 1}


def test_multi_row_jobs_split_back_as_views(make_scheduler, reference):
    scheduler, (instance,) = make_scheduler("add_sub", BATCHING_8, open_gate=False)
    rng = np.random.default_rng(7)

    def request(rows: int) -> dict[str, np.ndarray]:
        return {name: rng.standard_normal((rows, 16)).astype(np.float32) for name in ("INPUT0", "INPUT1")}

    hold_worker(scheduler, instance, request(1))
    jobs = submit_all(scheduler, [request(rows) for rows in (1, 2, 3, 2)])  # 8 rows: one batch
    instance.gate.set()
    outputs = []
    for job, result in jobs:
        got = result.outputs()
        expected = reference("add_sub", job.inputs)
        assert got.keys() == expected.keys() == {"OUTPUT0", "OUTPUT1"}
        for name in expected:
            assert got[name].shape == (job.batch_size, 16)
            np.testing.assert_array_equal(got[name], expected[name])
        outputs.append(got)
    assert scheduler.wait_idle(WAIT_S)
    assert instance.calls[1]["INPUT0"].shape == (8, 16)
    # every job's output is a row slice of the one batch output, not a copy: the slices are
    # adjacent in memory, job after job
    for (job, _), got, nxt in zip(jobs, outputs, outputs[1:], strict=False):
        for name in ("OUTPUT0", "OUTPUT1"):
            assert not got[name].flags.owndata
            start = got[name].__array_interface__["data"][0]
            assert nxt[name].__array_interface__["data"][0] == start + job.batch_size * 16 * 4
    assert batch_sizes(scheduler.stats.to_dict()) == {1: 1, 8: 1}
    assert scheduler.stats.to_dict()["inference_count"] == 9


def test_shape_incompatible_jobs_get_their_own_batches(make_scheduler, reference):
    scheduler, (instance,) = make_scheduler("conv", BATCHING_8, open_gate=False)
    rng = np.random.default_rng(3)

    def image(h: int, w: int) -> dict[str, np.ndarray]:
        return {"images": rng.standard_normal((1, 3, h, w)).astype(np.float32)}

    hold_worker(scheduler, instance, image(8, 8))
    sizes = [(8, 8), (16, 16), (8, 8), (16, 12), (16, 16), (8, 8)]
    jobs = submit_all(scheduler, [image(h, w) for h, w in sizes])
    instance.gate.set()
    for job, result in jobs:
        features = result.outputs()["features"]
        np.testing.assert_allclose(features, reference("conv", job.inputs)["features"], rtol=1e-5, atol=1e-5)
        assert features.shape == (1, 4, *job.inputs["images"].shape[2:])
    assert scheduler.wait_idle(WAIT_S)
    shapes = [call["images"].shape for call in instance.calls]
    assert shapes == [(1, 3, 8, 8), (3, 3, 8, 8), (2, 3, 16, 16), (1, 3, 16, 12)]
    assert batch_sizes(scheduler.stats.to_dict()) == {1: 2, 2: 1, 3: 1}


def test_dtype_mismatch_is_not_batched(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8, open_gate=False)
    hold_worker(scheduler, instance, mlp_input())
    f32, r32 = make_job(mlp_input())
    f64, r64 = make_job({"INPUT0": np.zeros((1, 16), dtype=np.float64)})
    scheduler.submit(f64)
    scheduler.submit(f32)
    instance.gate.set()
    assert isinstance(r64.error(), Exception)  # the model wants float32: ORT refuses that batch alone
    assert r32.outputs()["OUTPUT0"].shape == (1, 4)
    assert scheduler.wait_idle(WAIT_S)
    assert [c["INPUT0"].dtype for c in instance.calls[1:]] == [np.float64, np.float32]


def test_single_job_inputs_are_passed_without_copy(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8)
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    result.outputs()
    assert instance.calls[0]["INPUT0"] is job.inputs["INPUT0"]


def test_without_dynamic_batching_each_job_runs_alone(make_scheduler, reference):
    scheduler, (instance,) = make_scheduler("mlp", "max_batch_size: 8\n", open_gate=False)
    hold_worker(scheduler, instance, mlp_input())
    jobs = submit_all(scheduler, [mlp_input(seed=i) for i in range(3)])
    instance.gate.set()
    _assert_mlp_answers(jobs, reference)
    assert scheduler.wait_idle(WAIT_S)
    assert batch_sizes(scheduler.stats.to_dict()) == {1: 4}
    assert not scheduler.batching


def test_preferred_batch_size_runs_without_waiting_the_full_delay(make_scheduler):
    # A 60 s queue delay: the batch must start as soon as it reaches the preferred size.
    config = """
max_batch_size: 8
dynamic_batching { preferred_batch_size: [4] max_queue_delay_microseconds: 60000000 }
"""
    scheduler, _ = make_scheduler("mlp", config)
    jobs = [make_job(mlp_input(seed=i)) for i in range(4)]
    for job, _ in jobs:
        scheduler.submit(job)
    for _, result in jobs:
        assert result.outputs()["OUTPUT0"].shape == (1, 4)
    assert scheduler.wait_idle(WAIT_S)
    assert batch_sizes(scheduler.stats.to_dict()) == {4: 1}


def test_drain_flushes_a_batch_waiting_for_its_delay(make_scheduler):
    config = "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 60000000 }\n"
    scheduler, _ = make_scheduler("mlp", config)
    jobs = [make_job(mlp_input(seed=i)) for i in range(2)]
    for job, _ in jobs:
        scheduler.submit(job)
    assert asyncio.run(scheduler.drain(WAIT_S))
    for _, result in jobs:
        assert result.outputs()["OUTPUT0"].shape == (1, 4)
    assert batch_sizes(scheduler.stats.to_dict()) == {2: 1}


def test_one_worker_per_instance_runs_concurrently(make_scheduler):
    scheduler, instances = make_scheduler("mlp", "max_batch_size: 8\n", instances=2, open_gate=False)
    jobs = [make_job(mlp_input(seed=i)) for i in range(2)]
    for job, _ in jobs:
        scheduler.submit(job)
    for instance in instances:
        instance.wait_entered()  # both instances are inside infer() at once
    for instance in instances:
        instance.gate.set()
    for _, result in jobs:
        assert result.outputs()["OUTPUT0"].shape == (1, 4)


def test_concurrent_submitters_mixed_shapes_two_instances(make_scheduler, reference):
    config = "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 2000 }\n"
    scheduler, _ = make_scheduler("conv", config, instances=2)
    sizes = [(8, 8), (16, 16), (8, 12)]
    per_thread = 40
    submitted: list[list[tuple[object, object]]] = [[] for _ in range(4)]

    def submitter(index: int) -> None:
        rng = np.random.default_rng(index)
        for i in range(per_thread):
            h, w = sizes[(i + index) % len(sizes)]
            rows = 1 + (i % 2)
            job, result = make_job({"images": rng.standard_normal((rows, 3, h, w)).astype(np.float32)})
            scheduler.submit(job)
            submitted[index].append((job, result))

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    rows_total = 0
    for job, result in itertools.chain.from_iterable(submitted):
        expected = reference("conv", job.inputs)["features"]
        np.testing.assert_allclose(result.outputs()["features"], expected, rtol=1e-5, atol=1e-5)
        rows_total += job.batch_size
    assert scheduler.wait_idle(WAIT_S)
    assert all(result.calls == 1 for _, result in itertools.chain.from_iterable(submitted))
    stats = scheduler.stats.to_dict()
    assert stats["inference_stats"]["success"]["count"] == 4 * per_thread
    assert stats["inference_count"] == rows_total
    assert sum(size * count for size, count in batch_sizes(stats).items()) == rows_total
    assert max(batch_sizes(stats)) <= 8
