"""The batch size the plan serves where the config leaves `max_batch_size` open: the decision from
measured timings (pure: tests feed it numbers) and its record, cached with the race result.

Per batch size b the race measured the time per inference (median, and its spread: the lower and
upper quartile sample). The knee is the smallest b that the best size does not beat by more than the
noise (race_result.clearly_faster's rule: `least` (its MIN_MARGIN), or the larger relative spread /
sqrt(rounds)):
batching past it only adds latency. The served config keeps auto-complete's default as its floor
(`max_batch_size` = max(knee, default), so a request the default admitted is still admitted) and
asks the dynamic batcher for the knee (`preferred_batch_size: [knee]`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SIZES = (1, 2, 4, 8, 16)  # the batch sizes raced (capped by `[runtime] race_max_batch_size` and memory)


@dataclass(frozen=True)
class Timing:
    """ms per inference at one batch size: the median and the spread of the samples."""

    median: float
    low: float
    high: float

    def noise(self) -> float:
        return (self.high - self.low) / (2 * self.median) if self.median > 0 else 0.0


def knee(timings: dict[int, Timing], rounds: int, least: float) -> tuple[int, str]:
    """(the smallest batch size within the noise of the best per-inference time, why); `least`: the
    smallest gain that counts (race_result.MIN_MARGIN; a parameter, so this module imports no race)."""
    if not timings:
        raise ValueError("no batch size was timed")
    best_size = min(timings, key=lambda b: (timings[b].median, b))
    best = timings[best_size]
    root = math.sqrt(max(1, rounds))
    for size in sorted(timings):
        t = timings[size]
        margin = max(least, max(t.noise(), best.noise()) / root)
        if t.median <= best.median * (1 + margin):
            if size == best_size:
                return size, f"batch {size} was the fastest per inference"
            return size, (
                f"batch {size} is within {margin:.0%} of the fastest (batch {best_size}, "
                f"{best.median:.3g} ms/inference): larger batches only add latency"
            )
    return best_size, f"batch {best_size} was the fastest per inference"  # pragma: no cover


@dataclass
class BatchChoice:
    """What the batch-size race measured and chose (`size` 0: not measured, the default serves)."""

    size: int  # the knee: the dynamic batcher's preferred batch size
    max_batch_size: int  # what the served config gets: max(size, auto-complete's default)
    timings: dict[str, list[float]] = field(default_factory=dict)  # "b" -> [median, low, high] ms/inf
    layout: str = ""  # the candidate it was timed on (the race's winner)
    rounds: int = 0
    final: bool = True
    why: str = ""  # the decision, or why nothing was measured

    @classmethod
    def decide(
        cls, timings: dict[int, Timing], rounds: int, least: float, default: int, layout: str,
        final: bool = True,
    ) -> BatchChoice:  # fmt: skip
        size, why = knee(timings, rounds, least)
        return cls(
            size, max(size, default), {str(b): [t.median, t.low, t.high] for b, t in sorted(timings.items())},
            layout, rounds, final, why,
        )  # fmt: skip

    def summary(self) -> str:
        """One line for the served config's `batch_size_choice`, the log and `edgeserve detect`."""
        if not self.size:
            return f"batch size not raced: {self.why}; auto-complete's default serves"
        per = ", ".join(f"{b}: {v[0]:.3g}" for b, v in self.timings.items())
        state = "final" if self.final else "provisional"
        return (
            f"max_batch_size {self.max_batch_size}, preferred_batch_size {self.size}: {self.why} "
            f"(ms/inference by batch size on {self.layout}: {per}; {self.rounds} rounds; {state})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchChoice:
        """Raises (TypeError, KeyError, ValueError) on a malformed entry."""
        timings = {str(b): [float(x) for x in v] for b, v in dict(data["timings"]).items()}
        if any(len(v) != 3 for v in timings.values()):
            raise ValueError("a batch timing is not [median, low, high]")
        return cls(
            int(data["size"]), int(data["max_batch_size"]), timings, str(data.get("layout", "")),
            int(data.get("rounds", 0)), bool(data.get("final", True)), str(data.get("why", "")),
        )  # fmt: skip
