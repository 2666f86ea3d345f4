"""The load-time race: time the viable CPU candidates of a model on this box and serve the fastest that
passes the accuracy guard. Only what the config fixes is fixed: a pinned backend (or precision) still
races the layouts (and the other precisions) it leaves open; a pinned instance count or
`intra_op_thread_count` narrows the layouts.

Candidates: the plan's viable options (ONNX Runtime / OpenVINO on the CPU, each precision; options the
profile's size floor turned away are raced too: the floor is a guess, the race measures) x layouts
within the CPU budget (1 instance x all threads; 2 instances sharing them unless the config sets the
instance count; ONNX Runtime on 1 thread, as its load-time probe does). Scenarios, from the config:
1 request in flight at batch 1, and when the model batches, the dynamic batcher's preferred sizes (or
max_batch_size) with one batch in flight per instance. Score = geometric mean of the time per
inference over the scenarios.

Fair and bounded (race_timing.py): every candidate is compiled and warmed up first (the rule's choice
first, then the other options, then the other layouts), within `[runtime] race_budget_s` (compile +
timing), a clearly slower one dropped at once; then rounds A B C, B C A, ... (monotonic clock,
medians) as many as the rest of the budget allows, at least 3. A candidate that does not fit is not
timed ("over budget"). When the budget runs out before those rounds, the evidence there is decides:
every candidate warmed up is scored on its warm-up samples (medians, with their spread), and the result
is provisional (not final); only when fewer than two were warmed up does the rule's choice stay. A
provisional result is finished by a background race at low priority (race_background.py). Results,
provisional or final, are cached (race_result.py): a restart serves them at once.

What is timed (the scenarios, the feeds) and the cache key: race_workload.py. Where the config leaves
`max_batch_size` open, the winner is then timed at a few batch sizes in what is left of the budget,
and the knee serves (race_batch.py, batch_choice.py); cached with the result.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from edgeserve.hardware import race_batch, race_workload
from edgeserve.hardware.batch_choice import BatchChoice
from edgeserve.hardware.plan import ModelPlan, Planner, PlanOption, Verdict
from edgeserve.hardware.race_result import (
    MIN_MARGIN,
    OVER_BUDGET,
    REJECTED,
    SKIPPED,
    RaceCache,
    RaceResult,
    Row,
    clearly_faster,
)
from edgeserve.hardware.race_timing import (
    MAX_ROUNDS,
    MIN_ROUNDS,
    PRUNE,
    Entrant,
    Scenario,
    Stopwatch,
    close,
)
from edgeserve.hardware.race_workload import RACED_BACKENDS

log = logging.getLogger("edgeserve.hardware.race")
FINAL_ROUNDS = 5  # fewer timed rounds per candidate leave the race provisional (see _settle)


class Finisher(Protocol):
    """What finishes a provisional race while the model serves (race_background.BackgroundRaces): a
    Protocol, so this module does not import the one that builds on it."""

    def start(self, racer: Racer, job: Job, provisional: RaceResult) -> None: ...


PINNED_OUT = ("not the pinned", "config parameters.precision")  # the plan's reasons for what pins rule out
THREADS_PARAMETER = "intra_op_thread_count"  # the ORT backend's parameter: the race sets it, no probe
ONE = "nothing to race: the config fixes the runtime and its layout"  # the batch size may still be open
# The evidence of a result whose runtime choice is final and whose batch size is left to the background
BATCH_PENDING = "the runtime choice is final; the batch size is not measured yet"
# One race at a time in this process: two models loading in parallel must not time each other's load.
_RACING = threading.Lock()


@dataclass
class Job:
    """One model's race, ready to run (again: the background race reuses it)."""

    plan: ModelPlan
    name: str
    version_dir: Path
    config: Any
    where: str
    entrants: list[Entrant]
    rejected: list[Row]
    scenarios: list[Scenario]
    feeds: dict[int, Any]
    source: str  # what the candidates are fed
    completed: Any  # the auto-completed config
    digest: str
    key: str
    batch_sizes: list[int] = field(default_factory=list)  # raced on the winner (none: the config's)


class Racer:
    def __init__(
        self, planner: Planner, cache: RaceCache, budget_s: float, max_rounds: int = MAX_ROUNDS,
        prune: float = PRUNE,
    ) -> None:  # fmt: skip
        self.planner = planner
        self.cache = cache
        self.budget_s = budget_s
        self.max_rounds = max(MIN_ROUNDS, max_rounds)  # benchmarks time longer than a load does
        self.prune = prune  # math.inf: time every candidate that fits (a benchmark's reference)
        self.background: Finisher | None = None  # finishes a race the budget cut short

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

    def entrants(self, plan: ModelPlan, config: Any) -> tuple[list[Entrant], list[Row]]:
        """(candidates to time, in the order they are compiled; rows rejected before timing)."""
        pinned = sum(max(int(g.count), 0) for g in getattr(config, "instance_group", []))
        params = {k: v.string_value for k, v in config.parameters.items()} if config is not None else {}
        viable: list[Verdict] = []
        rejected: list[Row] = []
        for v in plan.verdicts:
            o = v.option
            if o.backend not in RACED_BACKENDS or o.device != "CPU" or v.reason.startswith(PINNED_OUT):
                continue  # what the config fixed is no candidate
            floor = "KiB floor for" in v.reason  # the profile's size guess: raced anyway
            if v.artifact is not None and (v.ok or not v.checked or floor):
                viable.append(v)
            else:
                rejected.append(Row(o.backend, o.device, o.precision, 0, 0, status=REJECTED, reason=v.reason))
        chosen = plan.chosen
        if chosen is not None and chosen in viable:  # the rule's choice is compiled first
            viable.remove(chosen)
            viable.insert(0, chosen)
        first: list[Entrant] = []
        rest: list[Entrant] = []
        for v in viable:
            o = v.option
            assert v.artifact is not None
            base = self.planner.backend_options(o, config, plan.pins)  # a pinned backend stays pinned
            layouts = self._layouts(o.backend, pinned, THREADS_PARAMETER in params)
            for number, (instances, threads) in enumerate(layouts):
                hint = base.performance_hint if o.backend == "openvino" else ""
                parameters = dict(base.parameters)
                if o.backend == "onnxruntime":
                    parameters.setdefault(THREADS_PARAMETER, str(threads))
                options = dataclasses.replace(base, threads=threads, parameters=parameters)
                guarded = o.precision not in ("fp32", "auto") and o.precision not in plan.pins.allowed
                row = Row(o.backend, o.device, o.precision, instances, threads, hint, guarded=guarded)
                (first if number == 0 else rest).append(Entrant(row, o, v.artifact, options, number == 0))
        return first + rest, rejected

    # -- the race --------------------------------------------------------------------------------
    def run(
        self, plan: ModelPlan, name: str, version_dir: Path, config: Any, where: str = "",
        fresh: bool = False, cached_only: bool = False,
    ) -> RaceResult | None:  # fmt: skip
        """The race's result (cached unless `fresh`), or None when there is nothing to race (or, with
        `cached_only`, nothing in the cache). A result that is not final (the budget ran out) goes to
        `self.background`, which finishes the race at low priority."""
        job = self.prepare(plan, name, version_dir, config, where)
        if job is None:
            return None
        if not fresh:
            cached = self.cache.get(job.digest, job.key)
            if cached is not None and self._still_accurate(
                cached, job.entrants, plan, name, version_dir, config, where
            ):
                log.info("model %s: race result from the cache: %s", name, cached.summary())
                if not cached.final and not cached_only and self.background is not None:
                    self.background.start(self, job, cached)
                return cached
        if cached_only:
            return None
        with _RACING:
            start = time.monotonic()
            result = self.race(job, job.entrants)
            if job.batch_sizes:
                self.race_batch(job, result, self.budget_s - (time.monotonic() - start))
        self.cache.put(job.digest, job.key, result)
        log.info("model %s: %s", name, result.summary())
        if not result.final and self.background is not None:
            self.background.start(self, job, result)
        return result

    def prepare(self, plan: ModelPlan, name: str, version_dir: Path, config: Any, where: str) -> Job | None:
        """What a race of this model needs (None: nothing to race)."""
        if self.budget_s <= 0 or plan.chosen is None:  # a pinned backend still races its layouts
            return None
        if plan.chosen.option.backend not in RACED_BACKENDS or plan.chosen.option.device != "CPU":
            return None  # accelerators (engines that build for minutes) keep the rule's order
        entrants, rejected = self.entrants(plan, config)
        if not entrants:
            return None
        multi = any(e.row.instances > 1 for e in entrants)
        try:
            completed = race_workload.complete(self.planner, plan, name, config, where)
            scenarios, feeds, source = race_workload.workload(
                name, version_dir, config, completed, where, multi
            )
        except Exception as exc:  # the load itself reports a bad model or config
            log.info("model %s: not raced: %s", name, exc)
            return None
        assert plan.chosen.artifact is not None
        from edgeserve.hardware.accuracy import model_digest

        sizes: list[int] = []
        if race_batch.batch_open(config, completed, where):
            most = max(e.row.instances for e in entrants)
            cap = self.planner.settings.runtime.race_max_batch_size
            sizes = race_batch.sizes_for(cap, feeds[1], most, self.planner.memory_budget())
        if len(entrants) < 2 and not sizes:
            return None  # one candidate, and the config fixes the batch size too
        digest = model_digest(plan.chosen.artifact)
        key = race_workload.key(self.planner, self.budget_s, entrants, scenarios, feeds, sizes)
        return Job(plan, name, version_dir, config, where, entrants, rejected, scenarios, feeds, source,
                   completed, digest, key, sizes)  # fmt: skip

    def race_batch(
        self, job: Job, result: RaceResult, budget_s: float, pace: Callable[[], float] | None = None
    ) -> None:
        """Time the winner at `job.batch_sizes` and put the choice in `result` (a provisional one makes
        the result provisional: the background race times it again)."""
        winner = result.chosen
        if winner is None and result.fallback == ONE:
            winner = job.entrants[0].row
        if winner is None:  # the rule's choice, with no evidence: the background race times it all
            return
        fresh = next((e for e in self.entrants(job.plan, job.config)[0] if e.row.label() == winner.label()),
                     None)  # fmt: skip
        default = self.planner.settings.runtime.default_max_batch_size
        if fresh is None:  # cannot happen: the winner is one of the job's candidates
            result.batch = BatchChoice(0, default, layout=winner.label(), final=False, why="no candidate")
            return
        fresh.row = dataclasses.replace(winner, ms=dict(winner.ms))
        sizes, base = job.batch_sizes, job.feeds[1]
        result.batch = race_batch.measure(fresh, sizes, base, job.completed, budget_s, default, pace)
        log.info("model %s: %s", job.name, result.batch.summary())
        if not result.batch.final and result.final:
            result.final, result.evidence = False, BATCH_PENDING

    def race(
        self, job: Job, entrants: list[Entrant], budget_s: float | None = None,
        pace: Callable[[], float] | None = None,
    ) -> RaceResult:  # fmt: skip
        """Time `entrants` (fresh ones: rows are filled in) and pick the winner."""
        if len(entrants) == 1:  # what serves is fixed: only the batch size is raced (race_batch)
            names = [s.name for s in job.scenarios]
            return RaceResult(job.name, names, [entrants[0].row], fallback=ONE, inputs=job.source)
        result = self._race(job.name, entrants, job.scenarios, job.feeds, job.completed, budget_s, pace)
        result.rows.extend(dataclasses.replace(r) for r in job.rejected)
        result.inputs = job.source
        if result.fallback is None:
            self._pick(result, entrants, job.plan, job.name, job.version_dir, job.config, job.where)
        if result.final:
            _settle(result)
        return result

    def _still_accurate(
        self, cached: RaceResult, entrants: list[Entrant], plan: ModelPlan, name: str, version_dir: Path,
        config: Any, where: str,
    ) -> bool:  # fmt: skip
        """A cached lower-precision winner is judged again (from the guard's own cache, so cheaply):
        the tolerance or the model's sample inputs may have changed since the race."""
        row = cached.chosen
        if row is None or not row.guarded or self.planner.guard is None:
            return True
        entrant = next((e for e in entrants if e.row.label() == row.label()), None)
        if entrant is None:
            return False
        tolerance = plan.pins.tolerance
        if tolerance is None:
            tolerance = self.planner.settings.runtime.accuracy_tolerance
        verdict = self.planner.check_accuracy(entrant.artifact, entrant.option, tolerance, name, version_dir,
                                              config, where)  # fmt: skip
        if not verdict.ok:
            log.info("model %s: the cached race winner %s no longer passes the accuracy guard (%s): racing "
                     "again", name, row.label(), verdict.reason)  # fmt: skip
        return verdict.ok

    def _race(
        self, name: str, entrants: list[Entrant], scenarios: list[Scenario], feeds: dict[int, Any],
        config: Any, budget_s: float | None = None, pace: Callable[[], float] | None = None,
    ) -> RaceResult:  # fmt: skip
        budget = self.budget_s if budget_s is None else budget_s
        total = self.planner.threads()[0]
        watch = Stopwatch(name, scenarios, feeds, config, budget, total, self.max_rounds, self.prune, pace)
        try:
            ready = watch.time(entrants)[0]
        finally:
            for e in entrants:
                close(e)
        result = RaceResult(name, [s.name for s in scenarios], [e.row for e in entrants], budget_s=budget)
        result.final = not watch.partial
        if watch.partial and len(ready) >= 2:
            # The evidence decides, not the rule: medians of the warm-up samples, with their spread.
            counts = sorted({e.row.rounds for e in ready})
            rounds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
            result.evidence = (
                f"decided on {rounds} warm-up round(s) per candidate: the {budget:g}s budget ran out "
                "before the timed rounds"
            )
        elif watch.partial:
            result.fallback = (
                f"over budget: fewer than 2 candidates could be compiled and warmed up within "
                f"{budget:g}s (compiling took {sum(e.row.compile_s for e in entrants):.1f}s); with no "
                "evidence to compare, the profile's order decides"
            )
        result.seconds = time.monotonic() - watch.start
        return result

    def _pick(
        self, result: RaceResult, entrants: list[Entrant], plan: ModelPlan, name: str, version_dir: Path,
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


def _settle(result: RaceResult) -> None:
    """A race is final only when it measured enough. Provisional (the background race times longer):
    - a candidate was left out for the budget (never compiled, or cut before the timed rounds): the
      race never measured it, and a rule or a guess must not stand in for that;
    - the winner or the runner-up (not one dropped as PRUNE x slower) has fewer than FINAL_ROUNDS
      timed rounds: under a CPU hog a 3-round
      median was 15-30% off a 30-second one (bench_plan, 2026-11-29), and its spread says little;
    - on a noisy box (a CPU hog preempting the runtimes' threads) the winner is not clearly faster
      than the runner-up: its order may be noise. Where the spread is small (a quiet box), a near
      tie is final: either is as fast."""
    winner = result.chosen
    runner = next((r for r in result.ranked() if r is not winner and r.status != REJECTED), None)
    left_out = [r.label() for r in result.rows if r.status == OVER_BUDGET]
    if winner is not None and left_out:
        result.final = False
        result.evidence = f"not raced within the budget: {', '.join(left_out)}"
        return
    rival = next((r for r in result.ranked() if r is not winner and r.status not in (REJECTED, SKIPPED)),
                 None)  # fmt: skip
    if winner is not None and rival is not None and min(winner.rounds, rival.rounds) < FINAL_ROUNDS:
        result.final = False
        result.evidence = (
            f"{min(winner.rounds, rival.rounds)} round(s) of {winner.label()} and {rival.label()}: "
            f"fewer than {FINAL_ROUNDS} do not settle an order"
        )
        return
    if winner is None or runner is None or clearly_faster(winner, runner):
        return
    if max(winner.noise(), runner.noise()) <= MIN_MARGIN:
        return
    result.final = False
    result.evidence = (
        f"{runner.label()} ({runner.evidence()}) is within the noise of the winner ({winner.evidence()})"
    )
