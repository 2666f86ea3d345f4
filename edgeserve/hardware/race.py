"""The load-time race: for a model with no pinned backend, time the viable CPU candidates on this box
and serve the fastest that passes the accuracy guard.

Candidates: the plan's viable options (ONNX Runtime / OpenVINO on the CPU, each precision; options the
profile's size floor turned away are raced too: the floor is a guess, the race measures) x layouts
within the CPU budget (1 instance x all threads; 2 instances sharing them unless the config sets the
instance count; ONNX Runtime on 1 thread, as its load-time probe does). Scenarios, from the config:
1 request in flight at batch 1, and when the model batches, the dynamic batcher's preferred sizes (or
max_batch_size) with one batch in flight per instance. Score = geometric mean of the time per
inference over the scenarios.

Fair and bounded: every candidate is compiled and warmed up first (the rule's choice first, then the
other options, then the other layouts), within `[runtime] race_budget_s` (compile + timing); then
rounds A B C, B C A, ... (monotonic clock, medians) as many as the rest of the budget allows, at
least 3. A candidate that does not fit is not timed ("over budget"); when fewer than two can be timed
the rule's choice stays and the result says why. Results are cached (race_result.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeserve.backends.options import BackendOptions
from edgeserve.hardware.plan import ModelPlan, Planner, PlanOption, Verdict
from edgeserve.hardware.race_result import (
    FAILED,
    OVER_BUDGET,
    REJECTED,
    SKIPPED,
    TIMED,
    RaceCache,
    RaceResult,
    Row,
)

log = logging.getLogger("edgeserve.hardware.race")

RACED_BACKENDS = ("onnxruntime", "openvino")
THREADS_PARAMETER = "intra_op_thread_count"  # the ORT backend's parameter: the race sets it, no probe
MIN_ROUNDS, MAX_ROUNDS = 3, 15
SMALL_S = 1e-3  # 1 intra-op thread (beside all of them) is raced only for models faster than this
RACE_VERSION = 1  # bump when what is timed changes, so old cache entries are not reused
# One race at a time in this process: two models loading in parallel must not time each other's load.
_RACING = threading.Lock()


@dataclass
class _Entrant:
    row: Row
    option: PlanOption
    artifact: Path
    options: BackendOptions
    instances: list[Any] = dataclasses.field(default_factory=list)
    pool: ThreadPoolExecutor | None = None
    estimate_s: float = 0.0  # one round of every scenario
    samples: dict[str, list[int]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class _Scenario:
    name: str
    batch: int
    saturate: bool  # one request per instance in flight (else one request in flight)


class Racer:
    def __init__(
        self, planner: Planner, cache: RaceCache, budget_s: float, max_rounds: int = MAX_ROUNDS
    ) -> None:
        self.planner = planner
        self.cache = cache
        self.budget_s = budget_s
        self.max_rounds = max(MIN_ROUNDS, max_rounds)  # benchmarks time longer than a load does

    # -- candidates ------------------------------------------------------------------------------
    def _layouts(self, backend: str, pinned_instances: int, threads_param: bool) -> list[tuple[int, int]]:
        total, _ = self.planner.threads()
        if pinned_instances:
            per = max(1, total // pinned_instances)
            out = [(pinned_instances, per)]
            if per > 1 and backend == "onnxruntime" and not threads_param:
                out.append((pinned_instances, 1))
            return out
        out = [(1, total)]
        if total > 1:
            out.append((2, max(1, total // 2)))
            if backend == "onnxruntime" and not threads_param:
                out.append((1, 1))
        return list(dict.fromkeys(out))

    def entrants(self, plan: ModelPlan, config: Any) -> tuple[list[_Entrant], list[Row]]:
        """(candidates to time, in the order they are compiled; rows rejected before timing)."""
        pinned = sum(max(int(g.count), 0) for g in getattr(config, "instance_group", []))
        params = {k: v.string_value for k, v in config.parameters.items()} if config is not None else {}
        viable: list[Verdict] = []
        rejected: list[Row] = []
        for v in plan.verdicts:
            o = v.option
            if o.backend not in RACED_BACKENDS or o.device != "CPU":
                continue
            floor = "KiB floor for" in v.reason  # the profile's size guess: raced anyway
            if v.artifact is not None and (v.ok or not v.checked or floor):
                viable.append(v)
            else:
                rejected.append(Row(o.backend, o.device, o.precision, 0, 0, status=REJECTED, reason=v.reason))
        chosen = plan.chosen
        if chosen is not None and chosen in viable:  # the rule's choice is compiled first
            viable.remove(chosen)
            viable.insert(0, chosen)
        first: list[_Entrant] = []
        rest: list[_Entrant] = []
        for v in viable:
            o = v.option
            assert v.artifact is not None
            base = self.planner.backend_options(o, config)
            layouts = self._layouts(o.backend, pinned, THREADS_PARAMETER in params)
            for number, (instances, threads) in enumerate(layouts):
                hint = base.performance_hint if o.backend == "openvino" else ""
                parameters = dict(base.parameters)
                if o.backend == "onnxruntime":
                    parameters.setdefault(THREADS_PARAMETER, str(threads))
                options = dataclasses.replace(base, threads=threads, parameters=parameters)
                guarded = o.precision not in ("fp32", "auto") and o.precision not in plan.pins.allowed
                row = Row(o.backend, o.device, o.precision, instances, threads, hint, guarded=guarded)
                (first if number == 0 else rest).append(_Entrant(row, o, v.artifact, options))
        return first + rest, rejected

    # -- the race --------------------------------------------------------------------------------
    def run(
        self, plan: ModelPlan, name: str, version_dir: Path, config: Any, where: str = "", fresh: bool = False
    ) -> RaceResult | None:
        """The race's result (cached unless `fresh`), or None when there is nothing to race."""
        if self.budget_s <= 0 or plan.chosen is None or plan.pins.backend:
            return None
        if plan.chosen.option.backend not in RACED_BACKENDS or plan.chosen.option.device != "CPU":
            return None  # accelerators (engines that build for minutes) keep the rule's order
        entrants, rejected = self.entrants(plan, config)
        if len(entrants) < 2:
            return None
        multi = any(e.row.instances > 1 for e in entrants)
        try:
            completed = self._complete(plan, name, config, where)
            scenarios, feeds, source = self._workload(name, version_dir, config, completed, where, multi)
        except Exception as exc:  # the load itself reports a bad model or config
            log.info("model %s: not raced: %s", name, exc)
            return None
        assert plan.chosen.artifact is not None
        from edgeserve.hardware.accuracy import model_digest

        digest = model_digest(plan.chosen.artifact)
        key = self._key(entrants, scenarios, feeds)
        if not fresh:
            cached = self.cache.get(digest, key)
            if cached is not None:
                log.info("model %s: race result from the cache: %s", name, cached.summary())
                return cached
        with _RACING:
            result = self._race(name, entrants, scenarios, feeds, completed)
        result.rows.extend(rejected)
        result.inputs = source
        if result.fallback is None:
            self._pick(result, entrants, plan, name, version_dir, config, where)
        self.cache.put(digest, key, result)
        log.info("model %s: %s", name, result.summary())
        return result

    def _complete(self, plan: ModelPlan, name: str, config: Any, where: str) -> Any:
        from tritonclient.grpc import model_config_pb2 as mc

        from edgeserve.backends.base import get_backend
        from edgeserve.repository import autocomplete

        assert plan.chosen is not None and plan.chosen.artifact is not None
        backend = get_backend(plan.chosen.option.backend)
        return autocomplete.complete(
            config if config is not None else mc.ModelConfig(), backend.inspect(plan.chosen.artifact),
            model_name=name, backend_name=backend.name, platform="", model_file=plan.chosen.artifact.name,
            default_max_batch_size=self.planner.settings.runtime.default_max_batch_size, where=where,
        )  # fmt: skip

    def _workload(
        self, name: str, version_dir: Path, config: Any, completed: Any, where: str, multi: bool
    ) -> tuple[list[_Scenario], dict[int, dict[str, Any]], str]:
        """Scenarios, a feed per batch size, and where the data came from."""
        from edgeserve.hardware.accuracy import sample_feeds
        from edgeserve.hardware.inputs import model_inputs
        from edgeserve.protocol import datatypes
        from edgeserve.repository.config import type_name

        batching = completed.max_batch_size > 0
        inputs = model_inputs(name, version_dir.parent, config, where)
        if inputs is not None:
            base = inputs.feeds[0]
            if batching:
                base = {k: v[:1] for k, v in base.items()}
            source = inputs.source
        else:
            specs = []
            for t in completed.input:
                dtype = datatypes.numpy_dtype(datatypes.config_to_protocol(type_name(t.data_type)))
                if dtype == np.object_:
                    raise ValueError(f"input '{t.name}' is BYTES")
                specs.append((t.name, dtype, ([-1] if batching else []) + [int(d) for d in t.dims]))
            base = sample_feeds(specs, 1, 0)[0]
            source = "random data on the config's shapes"
        sizes: list[int] = []
        if batching:
            preferred = [int(b) for b in completed.dynamic_batching.preferred_batch_size]
            wanted = preferred or [int(completed.max_batch_size)]
            sizes = sorted({b for b in wanted if 1 < b <= completed.max_batch_size})
        scenarios = [_Scenario("1 in flight", 1, False)]
        scenarios += [_Scenario(f"batch {b} x instances", b, True) for b in sizes]
        if not sizes and multi:
            scenarios.append(_Scenario("1 per instance", 1, True))
        feeds = {1: base}
        for b in sizes:
            feeds[b] = {k: np.concatenate([v] * b) for k, v in base.items()}
        return scenarios, feeds, source

    def _key(self, entrants: list[_Entrant], scenarios: list[_Scenario], feeds: dict[int, Any]) -> str:
        from edgeserve.hardware.accuracy import _cpu_model, _runtime_version

        planner = self.planner
        data = {
            "version": RACE_VERSION,
            "cpu": _cpu_model(),
            "cpus": planner.hw.budget.effective_cpus,
            "threads": planner.threads()[0],
            "profile": planner.profile.name,
            "runtimes": [_runtime_version(b) for b in RACED_BACKENDS],
            "budget_s": self.budget_s,
            "entrants": [e.row.label() for e in entrants],
            "scenarios": [(s.name, s.batch, s.saturate) for s in scenarios],
            "shapes": {b: {k: [str(v.dtype), list(v.shape)] for k, v in f.items()} for b, f in feeds.items()},
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def _race(
        self,
        name: str,
        entrants: list[_Entrant],
        scenarios: list[_Scenario],
        feeds: dict[int, Any],
        config: Any,
    ) -> RaceResult:
        from edgeserve.backends.base import get_backend

        start = time.monotonic()
        budget = self.budget_s
        compile_s: dict[str, float] = {}
        defaults: dict[PlanOption, float] = {}  # seconds per call of each option's first layout
        total, _ = self.planner.threads()
        log.info("model %s: racing %d candidates within %gs: %s", name, len(entrants), budget,
                 ", ".join(e.row.label() for e in entrants))  # fmt: skip
        try:
            for number, e in enumerate(entrants, 1):
                spent = time.monotonic() - start
                guess = compile_s.get(e.option.backend, 0.0) * e.row.instances
                # leave room for MIN_ROUNDS rounds of what is compiled, this one included (as slow as
                # the slowest so far): compiling everything first and timing nothing would be no race
                estimates = [x.estimate_s for x in entrants if x.instances]
                reserve = (MIN_ROUNDS - 1) * (sum(estimates) + max(estimates, default=0.0))
                if spent + guess > budget or (len(estimates) >= 2 and spent + guess + reserve > budget):
                    e.row.status = OVER_BUDGET
                    e.row.reason = (
                        f"not compiled: {spent:.1f}s of the {budget:g}s budget spent or kept for timing"
                    )
                    continue
                small = defaults.get(e.option)
                if e.row.threads < total and e.row.instances == 1 and small is not None and small > SMALL_S:
                    e.row.status = SKIPPED
                    e.row.reason = f"fewer threads only pay below {SMALL_S * 1e3:g} ms per call"
                    continue
                t0 = time.monotonic()
                try:
                    backend = get_backend(e.option.backend)
                    for _ in range(e.row.instances):
                        e.instances.append(backend.load(e.artifact, config, e.options))
                    e.row.compile_s = time.monotonic() - t0
                    compile_s[e.option.backend] = e.row.compile_s / e.row.instances
                    e.pool = ThreadPoolExecutor(e.row.instances, thread_name_prefix="race")
                    for s in scenarios:
                        _run(e, s, feeds[s.batch])  # first calls allocate: not timed
                    t1 = time.monotonic()
                    for s in scenarios:
                        e.samples[s.name] = [_run(e, s, feeds[s.batch])]  # warm: the first round
                    e.estimate_s = time.monotonic() - t1
                    defaults.setdefault(e.option, e.samples[scenarios[0].name][0] / 1e9)
                except Exception as exc:
                    e.row.status, e.row.reason = FAILED, _short(exc)
                    _close(e)
                    continue
                log.info("model %s: race %d/%d: %s compiled in %.2fs, %.2f ms per round", name, number,
                         len(entrants), e.row.label(), e.row.compile_s, e.estimate_s * 1e3)  # fmt: skip
            ready = [e for e in entrants if e.instances]
            while len(ready) > 1:  # keep the candidates that MIN_ROUNDS rounds can time, in order
                left = budget - (time.monotonic() - start)
                if (MIN_ROUNDS - 1) * sum(e.estimate_s for e in ready) <= left:
                    break
                cut = ready.pop()
                cut.row.status = OVER_BUDGET
                cut.row.reason = f"not timed: {cut.estimate_s * 1e3:.1f} ms per round does not fit the budget"
                _close(cut)
            result = RaceResult(name, [s.name for s in scenarios], [e.row for e in entrants], budget_s=budget)
            left = budget - (time.monotonic() - start)
            if len(ready) < 2 or (MIN_ROUNDS - 1) * sum(e.estimate_s for e in ready) > left:
                result.fallback = (
                    f"over budget: {len(ready)} of {len(entrants)} candidates compiled and warmed up in time "
                    f"for {MIN_ROUNDS} timed rounds within {budget:g}s (compiling took "
                    f"{sum(e.row.compile_s for e in entrants):.1f}s); the profile's order decides"
                )
                for e in ready:
                    e.row.status, e.row.reason = OVER_BUDGET, "too few candidates timed to race"
            else:
                rounds = self._rounds(name, ready, scenarios, feeds, start)
                for e in ready:
                    _score(e, scenarios, rounds)
            result.seconds = time.monotonic() - start
            return result
        finally:
            for e in entrants:
                _close(e)

    def _rounds(
        self,
        name: str,
        ready: list[_Entrant],
        scenarios: list[_Scenario],
        feeds: dict[int, Any],
        start: float,
    ) -> int:
        """Interleaved rounds (who goes first rotates) until the budget is spent: at least MIN_ROUNDS
        (the warm-up round counts), at most max_rounds. Returns the number of rounds taken."""
        log.info("model %s: timing %d candidates in rounds for up to %.1fs more", name, len(ready),
                 max(0.0, self.budget_s - (time.monotonic() - start)))  # fmt: skip
        durations: list[float] = []
        rounds = 1
        while rounds < self.max_rounds:
            if (
                rounds >= MIN_ROUNDS
                and time.monotonic() - start + statistics.median(durations) > self.budget_s
            ):
                break
            t0 = time.monotonic()
            order = ready[rounds % len(ready) :] + ready[: rounds % len(ready)]
            for e in order:
                for s in scenarios:
                    e.samples[s.name].append(_run(e, s, feeds[s.batch]))
            durations.append(time.monotonic() - t0)
            rounds += 1
        log.info("model %s: %d rounds timed", name, rounds)
        return rounds

    def _pick(
        self, result: RaceResult, entrants: list[_Entrant], plan: ModelPlan, name: str, version_dir: Path,
        config: Any, where: str,
    ) -> None:  # fmt: skip
        """The fastest timed row that passes the accuracy guard wins."""
        pins = plan.pins
        tolerance = (
            pins.tolerance if pins.tolerance is not None else self.planner.settings.runtime.accuracy_tolerance
        )
        by_row = {id(e.row): e for e in entrants}
        verdicts: dict[PlanOption, tuple[bool, str]] = {}
        for row in result.ranked():
            e = by_row[id(row)]
            if row.guarded and self.planner.guard is not None:
                if e.option not in verdicts:
                    guard = self.planner.check_accuracy(e.artifact, e.option, tolerance, name, version_dir,
                                                        config, where)  # fmt: skip
                    verdicts[e.option] = (guard.ok, "accuracy guard: " + guard.reason)
                ok, why = verdicts[e.option]
                row.reason = why
                if not ok:
                    row.status = REJECTED
                    continue
            result.winner = result.rows.index(row)
            return
        result.fallback = "no timed candidate passed the accuracy guard"


def _run(e: _Entrant, s: _Scenario, feed: dict[str, Any]) -> int:
    """Nanoseconds for one call (or one call per instance, at once, when the scenario saturates)."""
    t0 = time.perf_counter_ns()
    if s.saturate and e.pool is not None:
        for future in [e.pool.submit(i.infer, feed) for i in e.instances]:
            future.result()
    else:
        e.instances[0].infer(feed)
    return time.perf_counter_ns() - t0


def _score(e: _Entrant, scenarios: list[_Scenario], rounds: int) -> None:
    row = e.row
    logs = []
    for s in scenarios:
        ms = statistics.median(e.samples[s.name]) / 1e6
        row.ms[s.name] = ms
        row.per_item_ms[s.name] = ms / (s.batch * (len(e.instances) if s.saturate else 1))
        logs.append(math.log(max(row.per_item_ms[s.name], 1e-9)))
    row.score_ms = math.exp(sum(logs) / len(logs))
    row.rounds, row.status = rounds, TIMED


def _close(e: _Entrant) -> None:
    if e.pool is not None:
        e.pool.shutdown(wait=True)
        e.pool = None
    for instance in e.instances:
        try:
            instance.close()
        except Exception:
            log.debug("closing a race instance failed", exc_info=True)
    e.instances = []


def _short(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
