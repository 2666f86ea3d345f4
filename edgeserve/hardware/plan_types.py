"""The runtime plan's records: an option (backend x device x precision), the accuracy guard's verdict,
each option's verdict and a model's plan (what `edgeserve detect --json` and the selector read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edgeserve.backends.options import BackendOptions
from edgeserve.hardware.pins import Pins

if TYPE_CHECKING:
    from edgeserve.hardware.fidelity import OutputFigures


@dataclass(frozen=True)
class PlanOption:
    backend: str
    device: str
    precision: str
    providers: tuple[str, ...] = ()

    def label(self) -> str:
        text = f"{self.backend} {self.device} {self.precision}"
        if self.providers:
            short = [p.removesuffix("ExecutionProvider") for p in self.providers]
            text += f" [{', '.join(short)}]"
        return text


@dataclass(frozen=True)
class GuardResult:
    ok: bool
    reason: str  # e.g. "range err 1.6e-03, worst 6.5e-03, cos 0.99999 within tolerance 0.01 (cached)"
    error: float | None = None  # the largest range error over the outputs
    figures: tuple[OutputFigures, ...] = ()  # per output (fidelity.py)
    inputs: str = ""  # what it was measured on


class AccuracyGuard(Protocol):
    """(artifact path, option, tolerance[, representative inputs]) -> verdict; see accuracy.py. The
    inputs are passed only when the model ships some (a plain 3-argument callable also fits)."""

    def __call__(self, path: Path, option: PlanOption, tolerance: float, /) -> GuardResult: ...


@dataclass(frozen=True)
class Verdict:
    option: PlanOption
    ok: bool
    reason: str
    artifact: Path | None = None
    checked: bool = True  # False: viable statically, not guarded (lower preference than the choice)


@dataclass(frozen=True)
class ModelPlan:
    model: str
    version: str | None
    chosen: Verdict | None
    options: BackendOptions | None
    verdicts: tuple[Verdict, ...]
    pins: Pins = field(default_factory=Pins)
    error: str | None = None

    @property
    def rejected(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.ok and v.checked]

    @property
    def skipped(self) -> list[Verdict]:
        """Lower-precision options after the choice: never guarded, so neither rejected nor fallbacks."""
        return [v for v in self.verdicts if not v.ok and not v.checked]

    @property
    def fallbacks(self) -> list[Verdict]:
        """Viable options after the choice (tried in order if the choice fails to load)."""
        if self.chosen is None:
            return []
        after = self.verdicts[self.verdicts.index(self.chosen) + 1 :]
        return [v for v in after if v.ok]

    def to_dict(self) -> dict[str, Any]:
        def verdict(v: Verdict) -> dict[str, Any]:
            return {
                "backend": v.option.backend,
                "device": v.option.device,
                "precision": v.option.precision,
                "providers": list(v.option.providers),
                "ok": v.ok,
                "reason": v.reason,
                "artifact": v.artifact.name if v.artifact else None,
            }

        chosen = None
        if self.chosen is not None and self.options is not None:
            chosen = {
                **verdict(self.chosen),
                "threads": self.options.threads,
                "performance_hint": self.options.performance_hint,
            }
        return {
            "model": self.model,
            "version": self.version,
            "chosen": chosen,
            "error": self.error,
            "pinned": {
                "backend": self.pins.backend,
                "device": self.pins.device,
                "precision": self.pins.precision,
            },
            "rejected": [verdict(v) for v in self.rejected],
            "alternatives": [verdict(v) for v in self.fallbacks],
            "skipped": [verdict(v) for v in self.skipped],
        }
