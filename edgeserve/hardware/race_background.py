"""The background race: finishes a load-time race that the budget cut short, while the model serves.

A load never waits for it: the load serves the best choice the evidence allowed (race.py), and this
races the same candidates again in a daemon thread, at low priority:
- a bounded CPU share (SHARE): after each turn it idles for as long as the turn took, times
  (1 - SHARE) / SHARE;
- paused while any served model has requests queued, or a load-time race runs (it would time them);
- at the served model's own scheduling priority, not niced: at nice 19 a busy box (the other work that
  made the budget run out) leaves it a few percent of a core, so it would time the scheduler rather
  than the runtimes and would not end within a minute; the share and the pauses keep it off the
  requests' way instead;
- its budget (BUDGET_S, or twice the load's budget when that is larger) counts only the time it ran;
  a pass that budget cut short (a candidate left out, fewer than FINAL_ROUNDS rounds) is run once
  more with twice the budget (PASSES), so a box far busier than expected still gets a real race.
When it ends, the result is final and cached. If its winner is faster than what serves by more than
the samples' spread (worth_a_switch), the model is reloaded, which switches atomically: the new
instances load beside the old ones, the served map changes in one assignment and the old version
drains (manager.py), so no request fails or is dropped; the reload reads the final result from the
cache. Otherwise what serves stays, and the final result says so. Where the config leaves
`max_batch_size` open, the winner's batch size is timed again too (race_batch.py); a different knee
switches the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from edgeserve.hardware.race import _RACING, BATCH_PENDING, FINAL_ROUNDS, Job, Racer
from edgeserve.hardware.race_result import MIN_MARGIN, OVER_BUDGET, REJECTED, TIMED, RaceResult, Row

log = logging.getLogger("edgeserve.hardware.race")

SHARE = 0.6  # of the wall time the background race may run (24 s of racing in about 40 s)
BUDGET_S = 24.0  # active seconds (compile + timing), at least twice the load's budget
PASSES = 2  # a pass the budget cut short is run once more with twice the budget
POLL_S = 0.05  # how often a paused race looks again


class Cancelled(Exception):
    """The server stops: the background race ends, its candidates closed."""


class Pacer:
    """The Stopwatch's `pace`: holds the race back for its CPU share, while requests queue or another
    race runs; returns the seconds it held it."""

    def __init__(self, share: float, busy: Callable[[], bool], stop: threading.Event) -> None:
        self.share = share
        self.busy = busy
        self.stop = stop
        self.mark = time.monotonic()
        self.held = 0.0  # seconds held back in all

    def __call__(self) -> float:
        start = time.monotonic()
        self.stop.wait((start - self.mark) * (1 - self.share) / self.share)
        while not self.stop.is_set() and (_RACING.locked() or self.busy()):
            self.stop.wait(POLL_S)
        if self.stop.is_set():
            raise Cancelled
        self.mark = time.monotonic()
        self.held += self.mark - start
        return self.mark - start


class BackgroundRaces:
    """One background race per race key at a time; `attach` tells it when to pause and how to switch."""

    def __init__(self, share: float = SHARE, budget_s: float = BUDGET_S) -> None:
        self.share = share
        self.budget_s = budget_s
        self.busy: Callable[[], bool] = lambda: False
        self.switch: Callable[[str], None] = lambda name: None
        self.confirm: Callable[[str, RaceResult], None] = lambda name, result: None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}  # race key -> thread
        self._done: dict[str, threading.Event] = {}  # model -> set when its background race ended
        self.attached = False  # only a server races on (`edgeserve detect` and tests stop at the load)

    def attach(
        self,
        busy: Callable[[], bool],
        switch: Callable[[str], None],
        confirm: Callable[[str, RaceResult], None] = lambda name, result: None,
    ) -> None:
        """`switch` reloads a model onto the new winner; `confirm` marks what serves final when it won."""
        self.busy, self.switch, self.confirm, self.attached = busy, switch, confirm, True

    def start(self, racer: Racer, job: Job, provisional: RaceResult) -> None:
        with self._lock:
            if not self.attached or self._stop.is_set() or job.key in self._running:
                return
            done = self._done[job.name] = threading.Event()
            thread = threading.Thread(
                target=self._run, args=(racer, job, provisional, done), name=f"race-{job.name}", daemon=True
            )
            self._running[job.key] = thread
        log.info("model %s: racing on in the background (%.0f%% of the time, paused while requests queue)",
                 job.name, self.share * 100)  # fmt: skip
        thread.start()

    def wait(self, model: str, timeout_s: float) -> bool:
        """True once `model`'s background race (started already) has ended."""
        with self._lock:
            done = self._done.get(model)
        return done is not None and done.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        with self._lock:
            threads = list(self._running.values())
        for thread in threads:
            thread.join(timeout_s)

    def _run(self, racer: Racer, job: Job, provisional: RaceResult, done: threading.Event) -> None:
        try:
            self.finish(racer, job, provisional)
        except Cancelled:
            log.info("model %s: background race stopped", job.name)
        except Exception:  # it must never take the server down: what serves stays
            log.exception("model %s: background race failed", job.name)
        finally:
            with self._lock:
                self._running.pop(job.key, None)
            done.set()

    def finish(self, racer: Racer, job: Job, provisional: RaceResult) -> RaceResult:
        """Race `job` again (in the calling thread), cache the final result, switch if it won clearly."""
        budget = max(self.budget_s, 2 * racer.budget_s)
        pacer = Pacer(self.share, self.busy, self._stop)
        serving = served_label(racer, job, provisional)
        if provisional.evidence == BATCH_PENDING and job.batch_sizes:
            # the runtime's race was final: only the batch sizes are left to time
            result, left = dataclasses.replace(provisional, final=True, evidence="", cached=False), budget
        else:
            result, left = self._race_again(racer, job, budget, pacer, serving)
        if job.batch_sizes:
            racer.race_batch(job, result, left, pacer)
            if result.batch is not None:
                result.batch.final = True  # as the runtime's: the background's evidence is the last word
        if not result.final:  # even the background budget ran out: its evidence is the last word
            result.evidence = result.evidence or "background race: warm-up rounds only"
        result.final = True
        racer.cache.put(job.digest, job.key, result)
        log.info("model %s: background race: %s", job.name, result.summary())
        winner = result.chosen.label() if result.chosen is not None else None
        batch, served = _size(result), _size(provisional)
        if winner is not None and winner != serving and not self._stop.is_set():
            log.info("model %s: switching from %s to %s (measured faster in the background race)", job.name,
                     serving, winner)  # fmt: skip
            self.switch(job.name)
        elif batch != served and not self._stop.is_set():
            log.info("model %s: switching from batch size %s to %s (measured in the background race)",
                     job.name, served or "default", batch or "default")  # fmt: skip
            self.switch(job.name)
        elif not self._stop.is_set():
            self.confirm(job.name, result)
        return result

    def _race_again(
        self, racer: Racer, job: Job, budget: float, pacer: Pacer, serving: str
    ) -> tuple[RaceResult, float]:
        """The runtimes raced again (what serves kept when the winner is within the noise of it), and
        the budget left for the batch sizes."""
        started = time.monotonic()
        spent = 0.0
        for attempt in range(PASSES):
            entrants, _ = racer.entrants(job.plan, job.config)
            spent += budget * 2**attempt
            result = racer.race(job, entrants, budget * 2**attempt, pacer)
            short = _cut_short(result)
            if not short or attempt + 1 == PASSES or self._stop.is_set():
                break
            log.info("model %s: background race cut short (%s): one more pass with %gs", job.name, short,
                     budget * 2 ** (attempt + 1))  # fmt: skip
        ran = time.monotonic() - started - pacer.held
        budget = spent
        current = next((r for r in result.rows if r.label() == serving and r.status != REJECTED), None)
        best = result.chosen
        if (
            best is not None
            and current is not None
            and current is not best
            and current.score_ms is not None  # timed (not dropped as clearly slower)
            and not worth_a_switch(best, current)
        ):
            # inside the noise: a switch would buy nothing measurable
            result.winner = result.rows.index(current)
            result.evidence = (
                f"{best.label()} was {best.score_ms:.3g} ms/inference, within the noise of what serves "
                f"({current.evidence()}): no switch"
            )
        if result.chosen is None and result.fallback is None:
            result.fallback = "no timed candidate passed the accuracy guard"
        return result, max(budget - ran, budget / 4)  # the batch sizes get what the race left


def worth_a_switch(best: Row, current: Row) -> bool:
    """`best` beats what serves by more than the samples' whole spread (not the median's, as for the
    order of a race): on a busy box the load drifts between the race and the next minute, which the
    median of more rounds does not average out, and a switch costs a reload. Under a CPU hog and a test
    suite, resnet_nhwc's background race saw ORT 1x2 6% ahead of the 2x1 that served, switched, and
    the next 30 s measured 2x1 13% ahead."""
    if best.score_ms is None or current.score_ms is None:
        return False
    return best.score_ms * (1 + max(MIN_MARGIN, best.noise(), current.noise())) < current.score_ms


def _cut_short(result: RaceResult) -> str:
    """Why a race's budget ran out before it measured everything ("" when it did not): a box far
    busier than its budget assumed (a load average of 13 on 2 CPUs left open_nsfw 2 warm-up rounds in
    24 s). A noisy tie is not cut short: more rounds would not make either faster."""
    if result.fallback is not None and result.chosen is None:
        return result.fallback
    left_out = [r.label() for r in result.rows if r.status == OVER_BUDGET]
    if left_out:
        return "not raced: " + ", ".join(left_out)
    if any(r.rounds and r.rounds < FINAL_ROUNDS for r in result.rows if r.status == TIMED):
        return f"fewer than {FINAL_ROUNDS} timed rounds"
    return ""


def _size(result: RaceResult) -> int:
    return result.batch.size if result.batch is not None else 0


def served_label(racer: Racer, job: Job, provisional: RaceResult) -> str:
    """The candidate the provisional result serves: its winner, else the rule's choice in the layout a
    load without a race gets."""
    if provisional.chosen is not None:
        return provisional.chosen.label()
    assert job.plan.chosen is not None and job.plan.options is not None
    option, options = job.plan.chosen.option, job.plan.options
    instances = sum(max(int(g.count), 1) for g in getattr(job.config, "instance_group", [])) or 1
    hint = options.performance_hint if option.backend == "openvino" else ""
    return Row(option.backend, option.device, option.precision, instances, options.threads, hint).label()
