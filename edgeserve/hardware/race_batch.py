"""The batch-size race: where the config leaves `max_batch_size` open, time the race's winner (its
runtime, precision and instances x threads) at a few batch sizes and let batch_choice.py pick the knee.

Open means: the config names no `max_batch_size` (absent, not 0: a config that sets it, to any
value, keeps it), declares no tensors and no `preferred_batch_size` or sequence batcher, and the
model's tensors have a dynamic first axis (so auto-complete would make it batch at the default).
protobuf cannot tell an absent `max_batch_size` from 0, so the config.pbtxt text is read; a config
that is not that file (one sent with a load request) keeps the default.

Timing: SIZES up to `[runtime] race_max_batch_size`, without the sizes whose inputs would not fit
the memory budget (ACTIVATIONS x the input bytes per inference, a rough guess on purpose: a size
that still fails to run ends the list there). One untimed call per size, then interleaved rounds
(1 2 4 8 16, 2 4 8 16 1, ...; MAX_ROUNDS, more while they are cheap, as the race's), each call after
the race's idle gap, every instance busy with one batch (as the race's batch scenarios); medians of
the time per inference. It runs in what is left of the load's race budget; a round that does not fit
is not started, and with fewer than MIN_ROUNDS rounds the choice is provisional: the background race
(race_background.py) times it again.
"""

from __future__ import annotations

import copy
import re
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from edgeserve.hardware.batch_choice import SIZES, BatchChoice, Timing
from edgeserve.hardware.race_result import MIN_MARGIN
from edgeserve.hardware.race_timing import (
    CHEAP_MAX_ROUNDS,
    CHEAP_ROUNDS_S,
    GAP_S,
    MIN_ROUNDS,
    Entrant,
    Scenario,
    _quartiles,
    close,
    run_once,
    short,
)

MAX_ROUNDS = 15
ACTIVATIONS = 64  # a batch's working memory ~ this x its input bytes (CNN activations are tens of x)
MOST = 256  # the largest size raced whatever the setting says (its feed is built in memory)
_NAMED = re.compile(r"^\s*max_batch_size\s*:", re.MULTILINE)


def batch_open(config: Any, completed: Any, where: str) -> bool:
    """True when the plan chooses the batch size (see the module's docstring); `config` None: no
    config.pbtxt (`edgeserve detect --model`), as the server's empty one."""
    from tritonclient.grpc import model_config_pb2 as mc

    from edgeserve.protocol.model_config import parse_text

    config = config if config is not None else mc.ModelConfig()
    if int(config.max_batch_size) != 0 or int(completed.max_batch_size) <= 0:
        return False  # set by the config, or the model cannot batch (auto-complete left it 0)
    if config.input or config.output or config.WhichOneof("scheduling_choice") == "sequence_batching":
        return False
    if config.HasField("dynamic_batching") and config.dynamic_batching.preferred_batch_size:
        return False  # the config's preferred sizes need the max it meant

    path = Path(where)
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else None
        parsed = parse_text(text, where) if text is not None else mc.ModelConfig()
    except Exception:  # the load reports a config it cannot read; here it only means "not open"
        return False
    if parsed != config:
        return False  # not this folder's config.pbtxt (a load request's): it may have named it
    code = "\n".join(line.split("#", 1)[0] for line in (text or "").splitlines())
    return _NAMED.search(code) is None


def sizes_for(cap: int, base: dict[str, Any], instances: int, memory_budget: int | None) -> list[int]:
    """The batch sizes to race: SIZES up to `cap` (and `cap` itself), within the memory budget."""
    cap = min(cap, MOST)
    sizes = sorted({b for b in SIZES if b <= cap} | ({cap} if cap > 1 else set()))
    per_item = sum(int(np.asarray(v).nbytes) for v in base.values()) * ACTIVATIONS * max(1, instances)
    if memory_budget is not None:
        sizes = [b for b in sizes if b == 1 or b * per_item <= memory_budget]
    return sizes if len(sizes) > 1 else []


def measure(
    e: Entrant, sizes: list[int], base: dict[str, Any], config: Any, budget_s: float, default: int,
    pace: Callable[[], float] | None = None, max_rounds: int = MAX_ROUNDS,
) -> BatchChoice:  # fmt: skip
    """Time `e` (a fresh entrant of the winner) at `sizes` within `budget_s` and decide."""
    from edgeserve.backends.base import get_backend

    start, idle = time.monotonic(), 0.0

    def left() -> float:
        return budget_s - (time.monotonic() - start - idle)

    layout = e.row.label()
    one = e.row.ms.get("1 in flight", 0.0) / 1e3  # the race's figure: a first guess of a round
    guess = e.row.compile_s + MIN_ROUNDS * one * sum(sizes)
    if guess > left():
        why = f"the {budget_s:.1f}s left of the race budget would not fit it (about {guess:.1f}s)"
        return BatchChoice(0, default, layout=layout, final=False, why=why)
    cfg = copy.deepcopy(config)
    cfg.max_batch_size = max(sizes)  # a backend may size its buffers from it
    feeds = {b: {k: np.concatenate([v] * b) for k, v in base.items()} for b in sizes}
    samples: dict[int, list[int]] = {}
    rounds, failed = 0, ""
    try:
        try:
            backend = get_backend(e.option.backend)
            for _ in range(e.row.instances):
                e.instances.append(backend.load(e.artifact, cfg, e.options))
        except Exception as exc:  # never a failed load: the default serves, and the log says why
            return BatchChoice(0, default, layout=layout, why=f"{layout} did not load again: {short(exc)}")
        e.pool = ThreadPoolExecutor(e.row.instances, thread_name_prefix="race-batch")
        for b in sizes:
            try:
                run_once(e, _scenario(b, e), feeds[b])  # first calls allocate: not timed
            except Exception:  # out of memory, or a runtime limit: this size and above are not raced
                break
            samples[b] = []
        timed = list(samples)
        durations: list[float] = []
        # a round starts only when one more (as long as the median so far) fits what is left; rounds
        # that cheap go on to CHEAP_MAX_ROUNDS, as the race's: microsecond medians need samples
        while (
            len(timed) > 1
            and not failed
            and (rounds < max_rounds or (rounds < CHEAP_MAX_ROUNDS and sum(durations) < CHEAP_ROUNDS_S))
            and (not durations or statistics.median(durations) < left())
        ):
            t0, held = time.monotonic(), idle
            shift = rounds % len(timed)
            for b in timed[shift:] + timed[:shift]:
                if pace is not None:
                    idle += pace()  # raises when the server stops (the background race's pace)
                time.sleep(GAP_S)  # the previous call's worker threads go idle first
                try:
                    samples[b].append(run_once(e, _scenario(b, e), feeds[b]))
                except Exception as exc:
                    failed = f"batch {b} failed: {short(exc)}"
                    break
            else:
                durations.append(time.monotonic() - t0 - (idle - held))
                rounds += 1
    finally:
        close(e)
    if failed or len(samples) < 2:
        why = failed or f"only batch 1 ran on {layout}"
        return BatchChoice(0, default, layout=layout, why=why)  # final: timing it again would not help
    if rounds == 0:
        why = f"the {budget_s:.1f}s left of the race budget ended before a round"
        return BatchChoice(0, default, layout=layout, final=False, why=why)
    timings = {b: _timing(s[:rounds], b * e.row.instances) for b, s in samples.items()}
    return BatchChoice.decide(timings, rounds, MIN_MARGIN, default, layout, rounds >= MIN_ROUNDS)


def _scenario(b: int, e: Entrant) -> Scenario:
    """A batch per instance in flight (one instance: called directly, no pool hand-off to time)."""
    return Scenario(f"batch {b}", b, e.row.instances > 1)


def _timing(samples: list[int], items: int) -> Timing:
    low, high = _quartiles(samples)
    return Timing(statistics.median(samples) / 1e6 / items, low / 1e6 / items, high / 1e6 / items)
