"""The rule's evidence: measurements a device profile records with the CPU they came from, and the
order they give the profile's CPU candidates on this box.

A profile's `[[measurements]]` entry is one model timed warm, in-process, on each CPU runtime, on one CPU:

    [[measurements]]
    cpu = "AMD EPYC (Zen 5), 2 vCPUs under KVM"   # what it ran on, shown with the rule
    vendor = "amd"                                # amd | intel | arm | nvidia | qualcomm | apple | ...
    isa = "avx512_vnni"                           # the ISA tier of that CPU (TIERS)
    model = "ppocr_det [1,3,640,640]"
    ms = { onnxruntime = 57.0, openvino = 24.2 }  # ms per inference, fp32, batch 1, all threads
    source = "benchmarks/history/2026-11-22.md"   # where the run is written up

A runtime's speed relative to another depends on the vector units more than on anything else (OpenVINO
won PP-OCR by 1.7-2.3x on an AVX-512 EPYC and lost a ResNet-50 by 1.3x on an AVX2 one), so only
measurements from this box's tier apply: those of its vendor first, else other vendors' of the same
tier, else none and the profile's listed order stands (and says it is unmeasured here). Each measured
runtime scores the geometric mean, over the applicable models, of its time over the fastest's; the
profile's CPU candidates of measured runtimes are sorted by it in their own slots (accelerators and
unmeasured runtimes keep their places), ties keeping the profile's order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from edgeserve.hardware.probes.cpu import CpuInfo

# Highest first; a CPU is in the first tier whose feature it has (normalized names, probes/cpu.py).
X86_TIERS: tuple[str, ...] = ("amx", "avx512_vnni", "avx512", "avx2")
ARM_TIERS: tuple[str, ...] = ("i8mm", "dotprod", "neon")
TIERS = ("amx", "avx512_vnni", "avx512", "avx2", "sse", "i8mm", "dotprod", "neon", "armv8")
_VENDORS = {
    "genuineintel": "intel", "authenticamd": "amd", "hygongenuine": "hygon", "centaurhauls": "centaur",
    "arm": "arm", "nvidia": "nvidia", "qualcomm": "qualcomm", "apple": "apple",
}  # fmt: skip
_KEYS = {"cpu", "vendor", "isa", "model", "ms", "source", "date", "note"}


class CandidateLike(Protocol):
    """What the rule reads of a profile's candidate (profile.Candidate, which imports this module)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def note(self) -> str: ...


C = TypeVar("C", bound=CandidateLike)


class EvidenceError(ValueError):
    """A measurement entry that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Measurement:
    cpu: str
    vendor: str
    isa: str
    model: str
    ms: Mapping[str, float]  # backend -> ms per inference (fp32, on the CPU)
    source: str = ""
    date: str = ""

    def describe(self) -> str:
        times = ", ".join(f"{b} {v:.3g} ms" for b, v in sorted(self.ms.items(), key=lambda kv: kv[1]))
        return f"{self.model}: {times}"


@dataclass(frozen=True)
class CpuClass:
    vendor: str
    tier: str

    def __str__(self) -> str:
        return f"{self.vendor} {self.tier}"


@dataclass(frozen=True)
class Rule(Generic[C]):
    """The profile's candidates in the order for this CPU, and what that order rests on."""

    candidates: tuple[C, ...]
    cpu: CpuClass
    basis: str  # one line: the measurements it rests on, or that none applies here
    evidence: tuple[Measurement, ...] = ()
    scores: Mapping[str, float] = dataclasses.field(default_factory=dict)  # backend -> x the fastest

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu": {"vendor": self.cpu.vendor, "isa": self.cpu.tier},
            "basis": self.basis,
            "order": [f"{c.backend} {c.device}" for c in self.candidates],
            "scores": dict(self.scores),
            "evidence": [dataclasses.asdict(m) | {"ms": dict(m.ms)} for m in self.evidence],
        }


def cpu_class(cpu: CpuInfo) -> CpuClass:
    """(vendor, ISA tier) of a probed CPU: what decides whether a measurement applies to it."""
    raw = (cpu.vendor or "unknown").strip().lower()
    vendor = _VENDORS.get(raw, raw.split()[0] if raw else "unknown")
    if cpu.arch in ("x86_64", "x86"):
        tiers, base = X86_TIERS, "sse"
    elif cpu.arch == "aarch64":
        tiers, base = ARM_TIERS, "armv8"
    else:
        return CpuClass(vendor, cpu.arch)
    tier = next((feature for feature in tiers if feature in cpu.isa), base)
    return CpuClass(vendor, tier)


def parse_measurements(raw: Any, source: str) -> tuple[Measurement, ...]:
    if not isinstance(raw, list):
        raise EvidenceError(f"{source}: [[measurements]] must be an array of tables")
    out: list[Measurement] = []
    for i, entry in enumerate(raw):
        where = f"{source}: measurements[{i}]"
        if not isinstance(entry, Mapping):
            raise EvidenceError(f"{where}: each [[measurements]] entry must be a table")
        unknown = set(entry) - _KEYS
        if unknown:
            raise EvidenceError(f"{where}: unknown key(s) {sorted(unknown)}")
        for key in ("cpu", "vendor", "isa", "model"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise EvidenceError(f"{where}.{key}: required (the CPU a figure came from is the point)")
        isa = entry["isa"].strip().lower()
        if isa not in TIERS:
            raise EvidenceError(f"{where}.isa: {isa!r} is not one of {', '.join(TIERS)}")
        ms = entry.get("ms")
        if not isinstance(ms, Mapping) or len(ms) < 2:
            raise EvidenceError(f"{where}.ms: needs a table of two or more runtimes' ms per inference")
        for backend, value in ms.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise EvidenceError(f"{where}.ms.{backend}: expected a positive number, got {value!r}")
        out.append(
            Measurement(
                cpu=entry["cpu"].strip(), vendor=entry["vendor"].strip().lower(), isa=isa,
                model=entry["model"].strip(), ms={str(k): float(v) for k, v in ms.items()},
                source=str(entry.get("source", "")), date=str(entry.get("date", "")),
            )
        )  # fmt: skip
    return tuple(out)


def _scores(evidence: tuple[Measurement, ...]) -> dict[str, float]:
    logs: dict[str, list[float]] = {}
    for m in evidence:
        fastest = min(m.ms.values())
        for backend, value in m.ms.items():
            logs.setdefault(backend, []).append(math.log(value / fastest))
    return {b: round(math.exp(sum(v) / len(v)), 3) for b, v in logs.items()}


def rule_for(profile: str, listed: Sequence[C], measured: Sequence[Measurement], cpu: CpuInfo) -> Rule[C]:
    """Profile `profile`'s candidates ordered for this CPU by the measurements of its class, each CPU
    candidate's note saying what its place rests on."""
    here = cpu_class(cpu)
    same = tuple(m for m in measured if m.isa == here.tier and m.vendor == here.vendor)
    evidence = same or tuple(m for m in measured if m.isa == here.tier)
    if not evidence:
        elsewhere = sorted({f"{m.vendor} {m.isa}" for m in measured})
        seen = f" (it has some for {', '.join(elsewhere)} CPUs)" if elsewhere else ""
        basis = f"the profile's order, unmeasured on {here} CPUs: {profile} has no measurements for them"
        basis += seen
        return Rule(tuple(_noted(c, basis) for c in listed), here, basis)
    scores = _scores(evidence)
    slots = [i for i, c in enumerate(listed) if c.device == "CPU" and c.backend in scores]
    ordered = sorted((listed[i] for i in slots), key=lambda c: scores[c.backend])  # stable
    candidates = list(listed)
    for slot, cand in zip(slots, ordered, strict=True):
        candidates[slot] = cand
    kind = f"measured on {here} CPUs" if same else f"measured on other vendors' {here.tier} CPUs"
    ranking = ", ".join(f"{b} {s:.2f}x" for b, s in sorted(scores.items(), key=lambda kv: kv[1]))
    models = "; ".join(m.describe() for m in evidence)
    cpus = "; ".join(dict.fromkeys(m.cpu for m in evidence))
    basis = f"{kind}: {ranking} the fastest (geometric mean over {len(evidence)} model(s): {models}"
    basis += f"; on {cpus})"
    notes = f"rule {kind}: {ranking} the fastest over {len(evidence)} model(s)"
    return Rule(
        tuple(dataclasses.replace(c, note=notes) if c.backend in scores and c.device == "CPU" else c
              for c in candidates),
        here, basis, evidence, scores,
    )  # fmt: skip


def _noted(cand: C, basis: str) -> C:
    """An unmeasured CPU candidate says so (after the profile's own note); accelerators keep theirs."""
    if cand.device != "CPU":
        return cand
    short = basis.split(":")[0]
    return dataclasses.replace(cand, note=f"{cand.note}; {short}" if cand.note else short)
