"""What a load-time race measured (race.py): one row per candidate, the winner, and its on-disk cache.

The cache lives in `<cache dir>/race/<model sha256>.json`, one entry per race key (device
fingerprint, runtime versions, candidates, shapes, budget); it is written atomically, and a missing,
corrupt or unwritable file only means the model is raced again: never a failed load.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeserve.hardware.batch_choice import BatchChoice
from edgeserve.hardware.digest_cache import DigestCache

log = logging.getLogger("edgeserve.hardware.race")

TIMED, REJECTED, OVER_BUDGET, FAILED, SKIPPED = "timed", "rejected", "over budget", "failed", "skipped"
# The least gain worth a switch: below it, a busy box's drift alone could flip the order back.
MIN_MARGIN = 0.05


@dataclass
class Row:
    """One candidate: backend x precision x layout (instances x threads, OpenVINO hint)."""

    backend: str
    device: str
    precision: str
    instances: int
    threads: int
    hint: str = ""  # OpenVINO performance hint
    status: str = TIMED  # timed | rejected | over budget | failed | skipped
    reason: str = ""  # why it was not timed or lost on accuracy; the accuracy figures when guarded
    ms: dict[str, float] = field(default_factory=dict)  # scenario -> median ms per call
    per_item_ms: dict[str, float] = field(default_factory=dict)  # scenario -> ms per inference
    score_ms: float | None = None  # geometric mean of per_item_ms: lower is faster
    compile_s: float = 0.0
    rounds: int = 0
    guarded: bool = False  # a lower precision that must pass the accuracy guard
    # The spread of score_ms: the same geometric mean from each scenario's lower and upper quartile
    # sample (with 2 samples: the faster and the slower). A difference inside it is noise.
    low_ms: float | None = None
    high_ms: float | None = None

    def label(self) -> str:
        device = "" if self.device == "CPU" else f" {self.device}"
        hint = f" {self.hint.lower()}" if self.hint and self.hint != "LATENCY" else ""
        layout = f" {self.instances}x{self.threads}" if self.instances else ""  # none: rejected untimed
        return f"{self.backend}{device} {self.precision}{layout}{hint}"

    def noise(self) -> float:
        """Half the relative spread of score_ms (0.1 = +-10%)."""
        if self.score_ms is None or self.low_ms is None or self.high_ms is None or self.score_ms <= 0:
            return 0.0
        return (self.high_ms - self.low_ms) / (2 * self.score_ms)

    def evidence(self) -> str:
        if self.score_ms is None:
            return ""
        spread = f" [{self.low_ms:.3g}-{self.high_ms:.3g}]" if self.low_ms and self.high_ms else ""
        return f"{self.score_ms:.3g}{spread} ms/inference over {self.rounds} rounds"

    def throughput(self) -> float | None:
        """Inferences per second in the best scenario (the largest batch, all instances busy)."""
        if not self.per_item_ms:
            return None
        best = min(self.per_item_ms.values())
        return 1000.0 / best if best > 0 else None


def clearly_faster(a: Row, b: Row) -> bool:
    """`a` beats `b` by more than the noise of the medians (and by MIN_MARGIN at least). A median of n
    rounds wanders by about the samples' spread / sqrt(n): under a CPU hog single samples vary +-30%,
    yet 7 rounds tell a 20% gain apart."""
    if a.score_ms is None or b.score_ms is None:
        return False
    rounds = max(1, min(a.rounds, b.rounds))
    return a.score_ms * (1 + max(MIN_MARGIN, max(a.noise(), b.noise()) / math.sqrt(rounds))) < b.score_ms


@dataclass
class RaceResult:
    model: str
    scenarios: list[str]  # e.g. ["1 in flight", "batch 8 x instances"]
    rows: list[Row]
    winner: int | None = None  # index into rows
    fallback: str | None = None  # why the rule's choice stays (over budget, nothing to race ...)
    budget_s: float = 0.0
    seconds: float = 0.0
    inputs: str = ""  # what the candidates were fed
    cached: bool = False
    # False: decided on warm-up evidence (the budget ran out before MIN_ROUNDS rounds) or by the rule
    # with no evidence; a background race at low priority finishes it (race_background.py).
    final: bool = True
    evidence: str = ""  # what the decision rests on, when it is not a full race
    # The batch size, raced on the winner where the config leaves max_batch_size open (race_batch.py)
    batch: BatchChoice | None = None

    @property
    def chosen(self) -> Row | None:
        return self.rows[self.winner] if self.winner is not None else None

    def ranked(self) -> list[Row]:
        """Timed rows, fastest first."""
        timed = [r for r in self.rows if r.score_ms is not None]
        return sorted(timed, key=lambda r: r.score_ms or 0.0)

    def summary(self) -> str:
        """One line for logs and the served config: the winner against the others, and why."""
        state = "final" if self.final else "provisional, racing on in the background"
        if self.chosen is None:
            return f"race fell back to the rule: {self.fallback or 'no winner'} ({state})"
        others = [r for r in self.ranked() if r is not self.chosen][:3]
        text = f"raced: {self.chosen.label()} {self.chosen.score_ms:.3g} ms/inference"
        if others:
            text += " vs " + ", ".join(f"{r.label()} {r.score_ms:.3g}" for r in others)
        lost = [r for r in self.rows if r.status == REJECTED and r.score_ms is not None]
        if lost:
            text += "; faster but rejected: " + ", ".join(f"{r.label()} ({r.reason})" for r in lost)
        when = "cached" if self.cached else f"{self.seconds:.1f}s"
        text += f" ({', '.join(self.scenarios)}; {when}; {state}"
        if self.evidence:
            text += f"; {self.evidence}"
        text += ")"
        if self.batch is not None:
            text += f"; {self.batch.summary()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["summary"] = self.summary()
        chosen = self.chosen
        data["plan"] = {  # what serves and what it rests on (edgeserve detect --json, runtime-plan.json)
            "chosen": chosen.label() if chosen else None,
            "final": self.final,
            "evidence": chosen.evidence() if chosen else (self.fallback or ""),
        }
        if self.batch is not None:  # the batch size, where the config left it open
            data["plan"]["batch"] = self.batch.summary()
        data.pop("cached")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RaceResult:
        """Raises (TypeError, KeyError, ValueError) on a malformed entry."""
        rows = [Row(**row) for row in data["rows"]]
        winner = data.get("winner")
        if winner is not None and not 0 <= int(winner) < len(rows):
            raise ValueError("winner out of range")
        return cls(
            model=str(data["model"]),
            scenarios=[str(s) for s in data["scenarios"]],
            rows=rows,
            winner=None if winner is None else int(winner),
            fallback=data.get("fallback"),
            budget_s=float(data.get("budget_s", 0.0)),
            seconds=float(data.get("seconds", 0.0)),
            inputs=str(data.get("inputs", "")),
            cached=True,
            final=bool(data.get("final", True)),
            evidence=str(data.get("evidence", "")),
            batch=BatchChoice.from_dict(data["batch"]) if data.get("batch") else None,
        )

    def table(self) -> list[str]:
        """The human table of `edgeserve detect --model`."""
        cols = self.scenarios
        head = f"  {'candidate':34} " + " ".join(f"{c[:20]:>20}" for c in cols)
        head += f" {'inf/s':>8} {'ms/inf [spread] n':>24}  status"
        lines = [head]
        for row in self.rows:
            cells = " ".join(f"{(f'{row.ms[c]:.3f} ms' if c in row.ms else '-'):>20}" for c in cols)
            rate = row.throughput()
            spread = "-"
            if row.score_ms is not None:
                spread = f"{row.score_ms:.3g}"
                if row.low_ms is not None and row.high_ms is not None:
                    spread += f" [{row.low_ms:.3g}-{row.high_ms:.3g}]"
                spread += f" {row.rounds}"
            mark = "WINNER" if row is self.chosen else row.status
            why = f" ({row.reason})" if row.reason else ""
            rate_text = f"{rate:.1f}" if rate else "-"
            lines.append(f"  {row.label():34} {cells} {rate_text:>8} {spread:>24}  {mark}{why}")
        return lines


class RaceCache:
    """The race results of this box, per model file hash; every failure is logged and ignored."""

    def __init__(self, cache_dir: Path | None) -> None:
        self.cache = DigestCache(cache_dir, "race", "the race result", log)

    def get(self, digest: str, key: str) -> RaceResult | None:
        entry = self.cache.load(digest).get(key)
        if not isinstance(entry, dict):
            return None
        try:
            return RaceResult.from_dict(entry)
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            log.warning("ignoring a malformed race cache entry for %s (%s)", digest[:12], exc)
            return None

    def put(self, digest: str, key: str, result: RaceResult) -> None:
        if self.cache.cache_dir is None:
            return
        entries = self.cache.load(digest)
        entries[key] = result.to_dict()
        self.cache.store(digest, entries)
