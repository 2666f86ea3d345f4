"""The race's stopwatch (race.py decides what to race; this times it, fairly and within a budget).

1. Warm-up, one candidate at a time in the race's order: compile (one instance per layout instance),
   one untimed call per scenario (first calls allocate), then two timed rounds (up to ten for a fast
   model, within 20 ms: microsecond calls are noisy). A candidate is not compiled when the budget
   left would not also time what is already warm for MIN_ROUNDS rounds.
   One whose best warm-up sample is more than PRUNE x the best candidate's median is dropped at once
   ("clearly slower"): the budget goes to candidates that can still win, and the other layouts of
   a dropped option are not tried.
2. Interleaved rounds, who goes first rotating (A B C, B C A, ...), each turn after a 2 ms idle gap
   (OpenVINO's and ONNX Runtime's worker threads keep spinning a while after a call, and would tax
   whoever comes next: in a server only the winner runs), until the budget is spent (at least
   MIN_ROUNDS rounds counting the warm-up ones, at most max_rounds, or CHEAP_MAX_ROUNDS while the
   rounds so far took under CHEAP_ROUNDS_S); medians of each scenario.
Times come from perf_counter_ns (monotonic).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeserve.backends.options import BackendOptions
from edgeserve.hardware.plan import PlanOption
from edgeserve.hardware.race_result import FAILED, OVER_BUDGET, SKIPPED, TIMED, Row

log = logging.getLogger("edgeserve.hardware.race")

MIN_ROUNDS, MAX_ROUNDS = 3, 15
WARM_ROUNDS = 2  # timed rounds at warm-up (they count); their median is the candidate's estimate
WARM_S, WARM_MAX = 0.02, 10  # a fast model gets more warm-up rounds (up to 20 ms): µs calls are noisy
PRUNE = 2.0  # a candidate this many times slower than the best at warm-up is not timed further
GAP_S = 0.002  # idle time before each candidate's turn: another runtime's spinning threads settle
SMALL_S = 1e-3  # 1 intra-op thread (beside all of them) is raced only for models faster than this
# Rounds that cheap go on past max_rounds (up to CHEAP_MAX_ROUNDS, within CHEAP_ROUNDS_S of rounds):
# medians of microsecond calls need more samples, and a load spends a fraction of a second on them.
CHEAP_ROUNDS_S, CHEAP_MAX_ROUNDS = 0.5, 60


@dataclass(eq=False)  # identity: an entrant is one candidate being timed
class Entrant:
    row: Row
    option: PlanOption
    artifact: Path
    options: BackendOptions
    default: bool = True  # the option's first layout (the others come after every option's first)
    instances: list[Any] = dataclasses.field(default_factory=list)
    pool: ThreadPoolExecutor | None = None
    estimate_s: float = 0.0  # one round of every scenario (the better warm-up round)
    warm_score: float = 0.0  # the warm-up's ms per inference (medians; geometric mean over the scenarios)
    warm_best: float = 0.0  # the same from each scenario's fastest warm-up sample
    warm_worst: float = 0.0  # ... and from its slowest
    samples: dict[str, list[int]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    batch: int
    saturate: bool  # one request per instance in flight (else one request in flight)


class Stopwatch:
    def __init__(
        self, name: str, scenarios: list[Scenario], feeds: dict[int, Any], config: Any, budget_s: float,
        threads: int, max_rounds: int = MAX_ROUNDS, prune: float = PRUNE,
        pace: Callable[[], float] | None = None,
    ) -> None:  # fmt: skip
        """`pace`: called before each compile and each turn (the background race's throttle); returns
        the seconds it held the race back, which do not count against the budget."""
        self.name = name
        self.scenarios = scenarios
        self.feeds = feeds
        self.config = config
        self.budget_s = budget_s
        self.threads = threads
        self.max_rounds = max(MIN_ROUNDS, max_rounds)
        self.prune = prune
        self.pace = pace
        self.start = 0.0
        self.idle = 0.0  # seconds `pace` held the race back
        self.warmed = 0  # candidates warmed up so far
        # True when the budget ran out before MIN_ROUNDS rounds: `time` then returns the candidates
        # scored on their warm-up rounds (the evidence there is), not a race
        self.partial = False

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start - self.idle)

    def _pace(self) -> None:
        if self.pace is not None:
            self.idle += self.pace()

    def time(self, entrants: list[Entrant]) -> tuple[list[Entrant], int]:
        """Warm up and time `entrants` (rows are filled in); returns (the timed ones, rounds): none when
        fewer than two could be warmed up and timed in the budget, one when it beat every other
        candidate by PRUNE x at warm-up (scored on its warm-up rounds)."""
        self.start = time.monotonic()
        self.warmed = 0
        log.info("model %s: racing %d candidates within %gs: %s", self.name, len(entrants), self.budget_s,
                 ", ".join(e.row.label() for e in entrants))  # fmt: skip
        compile_s: dict[str, float] = {}
        pruned: set[PlanOption] = set()
        pending = [e for e in entrants if e.default]
        later = [e for e in entrants if not e.default]
        number = 0
        while pending or later:
            if not pending:  # the other layouts, the options that did best first
                best = {e.option: e.warm_score for e in entrants if e.default and e.warm_score > 0}
                later.sort(key=lambda e: best.get(e.option, math.inf))
                pending, later = later, []
            e = pending.pop(0)
            number += 1
            self._pace()
            if e.option in pruned:
                e.row.status, e.row.reason = SKIPPED, "its first layout was clearly slower"
                continue
            if not self._fits(e, entrants, compile_s):
                continue
            if self._warm(e, compile_s):
                log.info("model %s: race %d/%d: %s compiled in %.2fs, %.3g ms/inference warm", self.name,
                         number, len(entrants), e.row.label(), e.row.compile_s, e.warm_score)  # fmt: skip
                self._prune(entrants, pruned)
        ready = [e for e in entrants if e.instances]
        while len(ready) > 1 and (MIN_ROUNDS - WARM_ROUNDS) * sum(e.estimate_s for e in ready) > self.left():
            cut = ready.pop()  # the last in the race's order goes first
            cut.row.status = OVER_BUDGET
            cut.row.reason = f"not timed: {cut.estimate_s * 1e3:.1f} ms per round does not fit the budget"
            close(cut)
        dropped = any("clearly slower at warm-up" in e.row.reason for e in entrants)
        settled = all(e in ready or e.row.status in (SKIPPED, FAILED) for e in entrants)
        if len(ready) == 1 and dropped and settled:
            # every other candidate was measured and lost by PRUNE x (or cannot run): the warm-up
            # rounds are enough to call it
            _score(ready[0], self.scenarios, WARM_ROUNDS)
            return ready, WARM_ROUNDS
        if len(ready) < 2 or (MIN_ROUNDS - WARM_ROUNDS) * sum(e.estimate_s for e in ready) > self.left():
            return self._warm_only(entrants), WARM_ROUNDS  # no race: what the warm-up measured
        rounds = self._rounds(ready, self.max_rounds)
        for e in ready:
            _score(e, self.scenarios, rounds)
        return ready, rounds

    def _warm_only(self, entrants: list[Entrant]) -> list[Entrant]:
        """The budget ran out: every candidate warmed up (those cut from the rounds too) is scored on
        its warm-up samples, marked as such."""
        self.partial = True
        warm = [e for e in entrants if e.samples and e.row.status not in (SKIPPED, FAILED)]
        for e in warm:
            _score(e, self.scenarios, WARM_ROUNDS)
            e.row.reason = "warm-up rounds only: the budget ran out before the timed rounds"
        return warm

    def _fits(self, e: Entrant, entrants: list[Entrant], compile_s: dict[str, float]) -> bool:
        """Leave room for MIN_ROUNDS rounds of what is warm, this one included (as slow as the slowest):
        compiling everything and timing nothing would be no race. The first two always try."""
        spent = self.budget_s - self.left()
        guess = compile_s.get(e.option.backend, 0.0) * e.row.instances
        estimates = [x.estimate_s for x in entrants if x.instances]
        reserve = (MIN_ROUNDS - WARM_ROUNDS) * sum(estimates) + MIN_ROUNDS * max(estimates, default=0.0)
        if spent + guess > self.budget_s or (len(estimates) >= 2 and spent + guess + reserve > self.budget_s):
            e.row.status = OVER_BUDGET
            e.row.reason = (
                f"not compiled: {spent:.1f}s of the {self.budget_s:g}s budget spent or kept for timing"
            )
            return False
        first = next((x for x in entrants if x.option == e.option and x.default), None)
        if (
            e.row.instances == 1 and e.row.threads < self.threads and first is not None
            and first.estimate_s > 0 and first.row.ms.get(self.scenarios[0].name, 0.0) > SMALL_S * 1e3
        ):  # fmt: skip
            e.row.status, e.row.reason = (
                SKIPPED,
                f"fewer threads only pay below {SMALL_S * 1e3:g} ms per call",
            )
            return False
        return True

    def _warm(self, e: Entrant, compile_s: dict[str, float]) -> bool:
        from edgeserve.backends.base import get_backend

        t0 = time.monotonic()
        try:
            backend = get_backend(e.option.backend)
            for _ in range(e.row.instances):
                e.instances.append(backend.load(e.artifact, self.config, e.options))
            e.row.compile_s = time.monotonic() - t0
            compile_s[e.option.backend] = e.row.compile_s / e.row.instances
            e.pool = ThreadPoolExecutor(e.row.instances, thread_name_prefix="race")
            for s in self.scenarios:
                run_once(e, s, self.feeds[s.batch])  # first calls allocate: not timed
            rounds: list[float] = []
            e.samples = {s.name: [] for s in self.scenarios}
            time.sleep(GAP_S)
            while (
                not rounds
                or (len(rounds) < WARM_ROUNDS and self.left() > self._room(e, rounds))
                or (len(rounds) < WARM_MAX and sum(rounds) < WARM_S)
            ):  # a second round only within the budget: a slow model must not overrun it twice
                t1 = time.monotonic()
                for s in self.scenarios:
                    e.samples[s.name].append(run_once(e, s, self.feeds[s.batch]))
                rounds.append(time.monotonic() - t1)
        except Exception as exc:
            e.row.status, e.row.reason = FAILED, short(exc)
            close(e)
            return False
        e.estimate_s = statistics.median(rounds)
        warm = {s.name: statistics.median(e.samples[s.name]) / 1e6 for s in self.scenarios}
        e.warm_score = _geomean([warm[s.name] / _items(e, s) for s in self.scenarios])
        e.warm_best = _geomean([min(e.samples[s.name]) / 1e6 / _items(e, s) for s in self.scenarios])
        e.warm_worst = _geomean([max(e.samples[s.name]) / 1e6 / _items(e, s) for s in self.scenarios])
        e.row.ms = warm  # until timed
        self.warmed += 1
        return True

    def _room(self, e: Entrant, rounds: list[float]) -> float:
        """Budget to keep after a warm-up round: while no other candidate is warm, enough for the next
        one to compile and run a round (about this one's compile and three rounds: the untimed calls
        cost one), so that one slow model's warm-up does not spend the budget that evidence needs."""
        return 0.0 if self.warmed else e.row.compile_s + 3 * max(rounds)

    def _prune(self, entrants: list[Entrant], pruned: set[PlanOption]) -> None:
        """Drop a candidate whose best warm-up sample (noise only ever adds time: a spike on a shared
        box must not drop the fastest) is PRUNE x slower than the best candidate's median, times the
        best candidate's own spread (slowest / fastest sample): on a box where a CPU hog preempts the
        runtimes' threads, samples of one candidate vary 2-4x, and that is no evidence of 'slower'."""
        warm = [e for e in entrants if e.instances]
        leader = min(warm, key=lambda e: e.warm_score, default=None)
        best = leader.warm_score if leader is not None else 0.0
        spread = leader.warm_worst / leader.warm_best if leader is not None and leader.warm_best > 0 else 1.0
        for e in warm:
            if best > 0 and e.warm_best > self.prune * max(1.0, spread) * best:
                e.row.status = SKIPPED
                e.row.reason = (
                    f"clearly slower at warm-up ({e.warm_score / best:.1f}x the best): not timed further"
                )
                if e.default:
                    pruned.add(e.option)
                close(e)

    def _rounds(self, ready: list[Entrant], most: int) -> int:
        log.info("model %s: timing %d candidates in rounds for up to %.1fs more", self.name, len(ready),
                 max(0.0, self.left()))  # fmt: skip
        durations: list[float] = []
        rounds = WARM_ROUNDS
        while rounds < most or (rounds < CHEAP_MAX_ROUNDS and sum(durations) < CHEAP_ROUNDS_S):
            if rounds >= MIN_ROUNDS and statistics.median(durations) > self.left():
                break
            t0 = time.monotonic()
            shift = rounds % len(ready)
            for e in ready[shift:] + ready[:shift]:
                self._pace()
                time.sleep(GAP_S)  # the previous candidate's worker threads go idle first
                for s in self.scenarios:
                    e.samples[s.name].append(run_once(e, s, self.feeds[s.batch]))
            durations.append(time.monotonic() - t0)
            rounds += 1
        log.info("model %s: %d rounds timed", self.name, rounds)
        return rounds


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(x, 1e-9)) for x in values) / len(values))


def _quartiles(samples: list[int]) -> tuple[float, float]:
    """Lower and upper quartile (the two samples themselves when there are two)."""
    if len(samples) < 2:
        return float(samples[0]), float(samples[0])
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return (float(min(samples)), float(max(samples))) if len(samples) == 2 else (q[0], q[2])


def _items(e: Entrant, s: Scenario) -> int:
    return s.batch * (e.row.instances if s.saturate else 1)  # also once closed (cut, scored on warm-up)


def run_once(e: Entrant, s: Scenario, feed: dict[str, Any]) -> int:
    """Nanoseconds for one call (or one call per instance, at once, when the scenario saturates)."""
    t0 = time.perf_counter_ns()
    if s.saturate and e.pool is not None:
        for future in [e.pool.submit(i.infer, feed) for i in e.instances]:
            future.result()
    else:
        e.instances[0].infer(feed)
    return time.perf_counter_ns() - t0


def _score(e: Entrant, scenarios: list[Scenario], rounds: int) -> None:
    row = e.row
    logs, lows, highs = [], [], []
    for s in scenarios:
        samples = e.samples[s.name]
        ms = statistics.median(samples) / 1e6
        row.ms[s.name] = ms
        row.per_item_ms[s.name] = ms / _items(e, s)
        logs.append(math.log(max(row.per_item_ms[s.name], 1e-9)))
        low, high = _quartiles(samples)
        lows.append(low / 1e6 / _items(e, s))
        highs.append(high / 1e6 / _items(e, s))
    row.score_ms = math.exp(sum(logs) / len(logs))
    row.low_ms, row.high_ms = _geomean(lows), _geomean(highs)
    row.rounds, row.status = len(e.samples[scenarios[0].name]), TIMED


def close(e: Entrant) -> None:
    if e.pool is not None:
        e.pool.shutdown(wait=True)
        e.pool = None
    for instance in e.instances:
        try:
            instance.close()
        except Exception:
            log.debug("closing a race instance failed", exc_info=True)
    e.instances = []


def short(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
