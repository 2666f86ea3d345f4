"""`tune`'s search space: candidate configs and how each one rewrites the model's config.

A candidate pins what edgeserve's runtime plan would otherwise choose (hardware/pins.py): the backend
(`backend`), the precision (`parameters.precision`), instances (`instance_group` count), intra-op
threads (`intra_op_thread_count` for ONNX Runtime, as Triton's ORT backend; `INFERENCE_NUM_THREADS`
for OpenVINO, as Triton's OpenVINO backend), and, for a batching model, `max_batch_size` and the
dynamic batcher's `max_queue_delay_microseconds`. The search runs in stages, each from the best so far
(Model Analyzer's quick search, small enough for a device):

1. runtime: every backend x precision, one instance with every core;
2. layout: the two best runtimes with other instance x thread splits of the cores;
3. batching: the best so far without the dynamic batcher and with other queue delays / batch sizes.

Every stage is a pure function of the results before it, so a rerun walks the same candidates and
skips the ones already measured.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

THREAD_KEYS = {"onnxruntime": "intra_op_thread_count", "openvino": "INFERENCE_NUM_THREADS"}
RUNTIME_MODULES = {"onnxruntime": "onnxruntime", "openvino": "openvino"}
QUEUE_DELAYS_US = (0, 500, 2000)
INT8_FILENAME = "model_int8.onnx"  # an --int8-model candidate's artifact, sent with the load request
INT8_IR_FILENAME = "model_int8.xml"  # an NNCF-quantized OpenVINO IR (`tune --int8`), its .bin beside it


@dataclass(frozen=True)
class Candidate:
    backend: str = ""  # "" = as configured (the baseline: the server's own choices)
    precision: str = ""
    instances: int = 0
    threads: int = 0
    max_batch_size: int = -1  # -1 = as configured
    dynamic_batching: bool = True
    queue_delay_us: int = -1  # -1 = as configured
    model: str = ""  # "" = the model's own artifact; "int8:<sha256 prefix>" = an INT8 ONNX (--int8-model or
    # calibrated by --int8), "int8-ir:<sha256 prefix>" = an OpenVINO IR quantized with NNCF (--int8)

    @property
    def baseline(self) -> bool:
        return not self.backend

    @property
    def label(self) -> str:
        if self.baseline:
            return "as configured"
        kind = self.precision
        if self.model:
            kind = "int8-ir" if self.model.startswith("int8-ir:") else "int8-model"
        text = f"{self.backend} {kind} {self.instances}x{self.threads}t"
        if self.max_batch_size > 0:
            text += f" mbs{self.max_batch_size}"
            if not self.dynamic_batching:
                text += " no-batcher"
            elif self.queue_delay_us >= 0:
                text += f" delay{self.queue_delay_us}us"
        return text

    def key(self, context: dict[str, Any]) -> str:
        blob = json.dumps({"candidate": asdict(self), **context}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def available_backends(version_dir: Path) -> list[str]:
    """Backends that can run this model here: an artifact they read, and their runtime installed
    (found, not imported)."""
    import importlib.util

    names = {p.name for p in version_dir.iterdir()} if version_dir.is_dir() else set()
    found: list[str] = []
    if ("model.onnx" in names) and importlib.util.find_spec("onnxruntime") is not None:
        found.append("onnxruntime")
    if names & {"model.onnx", "model.xml"} and importlib.util.find_spec("openvino") is not None:
        found.append("openvino")
    return found


def cpu_precisions(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """fp32, and bf16 / fp16 where the CPU computes them natively (OpenVINO on CPU)."""
    try:
        flags = set(cpuinfo.read_text(errors="replace").split())
    except OSError:
        flags = set()
    found = ["fp32"]
    if flags & {"avx512_bf16", "amx_bf16"}:
        found.append("bf16")
    # OpenVINO's CPU plugin runs f16 only on AMX-FP16 on x86: with AVX512-FP16 alone it refuses the hint,
    # and the candidate would only fail to load (wasting a --max-candidates slot).
    if "amx_fp16" in flags:
        found.append("fp16")
    return found


def precisions_for(backend: str, allowed: Sequence[str]) -> list[str]:
    # ONNX Runtime's CPU provider has no bf16/fp16 kernels worth running: fp32 only there.
    return [p for p in allowed if backend == "openvino" or p == "fp32"]


def layouts(cores: int) -> list[tuple[int, int]]:
    """(instances, threads each) splits with instances x threads <= cores, every core used first."""
    found: list[tuple[int, int]] = []
    instances = 1
    while instances <= cores:
        for threads in dict.fromkeys((max(1, cores // instances), 1)):
            found.append((instances, threads))
        instances *= 2
    return found


Score = Callable[[Candidate], float | None]  # None = not measured (or failed)


def search(
    backends: Sequence[str],
    precisions: Sequence[str],
    base_max_batch: int,
    score: Score,
    cores: int | None = None,
    extra_models: Sequence[str] = (),
) -> Iterator[Candidate]:
    """The candidates in order. `score(c)` is read after `c` was yielded (so measured by then)."""
    cores = cores or os.cpu_count() or 1
    batch = base_max_batch if base_max_batch > 0 else -1
    runtimes = [
        Candidate(b, p, 1, cores, batch, True, -1) for b in backends for p in precisions_for(b, precisions)
    ]
    # a quantized model runs as it is (its int8 ops are in the graph): fp32 is the runtime's setting
    runtimes += [Candidate(b, "fp32", 1, cores, batch, True, -1, m) for m in extra_models for b in backends]
    yield from runtimes
    yield Candidate()

    def best(pool: Sequence[Candidate]) -> list[Candidate]:
        scored = [(s, c) for c in pool if (s := score(c)) is not None]
        return [c for s, c in sorted(scored, key=lambda sc: -sc[0])]

    seen = set(runtimes)
    top = best(runtimes)[:2]
    layout_pool = list(top)
    for runtime in top:
        for instances, threads in layouts(cores):
            candidate = replace(runtime, instances=instances, threads=threads)
            if candidate not in seen:
                seen.add(candidate)
                layout_pool.append(candidate)
                yield candidate
    winners = best(layout_pool)
    if base_max_batch <= 0 or not winners:
        return
    lead = winners[0]
    options = [replace(lead, dynamic_batching=False, queue_delay_us=-1)]
    for size in dict.fromkeys((base_max_batch, base_max_batch * 2)):
        options += [replace(lead, max_batch_size=size, queue_delay_us=d) for d in QUEUE_DELAYS_US]
    for candidate in options:
        if candidate not in seen:
            seen.add(candidate)
            yield candidate


def apply(base: Any, candidate: Candidate) -> Any:
    """A copy of the ModelConfig `base` rewritten for `candidate`."""
    from tritonclient.grpc import model_config_pb2 as mc

    config = mc.ModelConfig()
    config.CopyFrom(base)
    if candidate.baseline:
        return config
    config.backend = candidate.backend
    config.platform = ""
    config.parameters["precision"].string_value = candidate.precision
    if candidate.model:
        config.default_model_filename = (
            INT8_IR_FILENAME if candidate.model.startswith("int8-ir:") else INT8_FILENAME
        )
    for key in THREAD_KEYS.values():
        if key in config.parameters:
            del config.parameters[key]
    config.parameters[THREAD_KEYS[candidate.backend]].string_value = str(candidate.threads)
    del config.instance_group[:]
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=candidate.instances)
    if base.max_batch_size > 0 and candidate.max_batch_size > 0:
        config.max_batch_size = candidate.max_batch_size
        if not candidate.dynamic_batching:
            config.ClearField("dynamic_batching")
        else:
            batcher = config.dynamic_batching
            if candidate.queue_delay_us >= 0:
                batcher.max_queue_delay_microseconds = candidate.queue_delay_us
            kept = [s for s in batcher.preferred_batch_size if s <= candidate.max_batch_size]
            del batcher.preferred_batch_size[:]
            batcher.preferred_batch_size.extend(kept)
        kept_warmup = [w for w in config.model_warmup if w.batch_size <= candidate.max_batch_size]
        del config.model_warmup[:]
        config.model_warmup.extend(kept_warmup)
    return config
