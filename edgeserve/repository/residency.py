"""Many models under a memory budget: which models are resident, what each costs, and which to evict.

The repository asks `Residency.reserve` before it loads a model version (at start, on an explicit
load, on a request to a load-on-first-use or evicted model, on an instance scale-up). When the
resident models' cost plus the new one's would pass the budget, the least recently used models that
can go (not pinned, not busy, not loading) are unloaded through the repository's own drained unload
path until it fits; when nothing more can go the load fails with RESOURCE_EXHAUSTED, naming the
budget, what is resident and the fix.

A version's cost is measured as the process RSS growth around its load (a lower bound: a load can
reuse memory freed by an unload) and never taken below its files' size x `FILE_FACTOR` plus
`INSTANCE_OVERHEAD` per instance; a load that imported a runtime (the first one) counts only that
floor, the import being the server's, not the model's. The measured figure is remembered per (model,
version) and used as the estimate for its next load.

Model config `parameters` (Triton has no standard for these):
  `load_on_first_use: "true"`: not loaded at start; the first request loads it (and waits for it);
  `pinned: "true"`: never evicted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeserve.protocol.errors import InferenceError, Status

log = logging.getLogger("edgeserve.repository.residency")

MIB = 2**20
EVICTED_REASON = "unloaded: memory budget (LRU)"
FIRST_USE_REASON = "not loaded: load on first use"
FILE_FACTOR = 2.0  # weights + their prepacked copy (ONNX Runtime MLAS prepacks MatMul weights)
INSTANCE_OVERHEAD = 8 * 2**20  # a runtime session's own memory (ONNX Runtime: 7-12 MiB measured here)
MAX_REMEMBERED = 4096  # measured costs kept (model, version); bounded for months of reloads
ROOM_WAIT_S = 10.0  # a load waits this long for loads in progress / busy models before giving up
ROOM_POLL_S = 0.05
_TRUE = ("1", "true", "yes", "on")


def param_true(config: Any, key: str) -> bool:
    """A model config's `parameters { key: ... value { string_value: "true" } }`."""
    params = getattr(config, "parameters", None)
    if params is None or key not in params:
        return False
    return str(params[key].string_value).strip().lower() in _TRUE


def model_flags(model_dir: Path) -> tuple[bool, bool]:
    """(load_on_first_use, pinned) from the folder's config.pbtxt; (False, False) when unreadable
    (the load then reports the config problem)."""
    from edgeserve.repository.config import parse_pbtxt
    from edgeserve.repository.layout import CONFIG_FILE

    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return False, False
    try:
        config = parse_pbtxt(path)
    except Exception:
        return False, False
    return param_true(config, "load_on_first_use"), param_true(config, "pinned")


def rss_bytes(children: bool = False) -> int:
    """This process's resident set size (Linux /proc/self/statm; psutil elsewhere), plus its child
    processes' with `children` (Python models run their instances in worker processes)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            total = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        total = 0
    if total and not children:
        return total
    import psutil

    me = psutil.Process()
    total = total or int(me.memory_info().rss)
    if children:
        for child in me.children(recursive=True)[:256]:
            try:
                total += int(child.memory_info().rss)
            except psutil.Error:
                continue
    return total


def floor_bytes(version_dir: Path, instances: int) -> int:
    """The least a version with `instances` instances is taken to cost."""
    return (int(files_bytes(version_dir) * FILE_FACTOR) + INSTANCE_OVERHEAD) * max(1, instances)


def files_bytes(folder: Path, limit: int = 10_000) -> int:
    """Total size of the files under `folder` (at most `limit` files looked at)."""
    total = 0
    for count, path in enumerate(folder.rglob("*")):
        if count >= limit:
            break
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue
    return total


def choose_victims(
    resident: Mapping[str, int], last_used: Mapping[str, int], need: int, evictable: Callable[[str], bool]
) -> list[str] | None:
    """The least recently used evictable models whose costs add up to at least `need` bytes, oldest
    first; [] when `need` <= 0; None when all evictable models together do not free enough."""
    if need <= 0:
        return []
    chosen: list[str] = []
    freed = 0
    for name in sorted(resident, key=lambda n: (last_used.get(n, 0), n)):
        if not evictable(name):
            continue
        chosen.append(name)
        freed += resident[name]
        if freed >= need:
            return chosen
    return None


@dataclass(eq=False)
class Charge:
    """Memory held (or reserved) by one loaded model version."""

    name: str
    version: int
    nbytes: int


class Residency:
    """The budget, the resident models' costs and their last use; the event loop thread owns it
    (`touch` may be called from any thread: one dict store)."""

    def __init__(
        self, budget_bytes: int | None, budget_reason: str, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self.budget_bytes = budget_bytes  # None: no budget (nothing is ever evicted)
        self.budget_reason = budget_reason
        self._clock = clock
        self.last_used: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.first_use: set[str] = set()  # load_on_first_use models
        self.evicted: set[str] = set()  # unloaded for memory; reloaded by their next request
        self.held_off: set[str] = set()  # unloaded through the API: no load on demand until loaded again
        self.evictions: Counter[str] = Counter()
        self._costs: dict[tuple[str, int], int] = {}
        self._charges: dict[int, Charge] = {}  # id(served model) -> charge
        self._pending: set[Charge] = set()  # reserved, loading
        self._lock: asyncio.Lock | None = None
        self.room_wait_s = ROOM_WAIT_S

    # -- bookkeeping -------------------------------------------------------------------------------
    def touch(self, name: str) -> None:
        self.last_used[name] = self._clock()

    def used(self) -> int:
        return sum(c.nbytes for c in self._charges.values()) + sum(c.nbytes for c in self._pending)

    def resident(self) -> dict[str, int]:
        """Model name -> bytes its loaded versions hold."""
        out: dict[str, int] = {}
        for charge in self._charges.values():
            out[charge.name] = out.get(charge.name, 0) + charge.nbytes
        return out

    def on_demand(self, name: str) -> bool:
        """True when a request for `name` (not loaded) should load it."""
        return (name in self.first_use or name in self.evicted) and name not in self.held_off

    def note_flags(self, name: str, first_use: bool, pinned: bool) -> None:
        for flag, names in ((first_use, self.first_use), (pinned, self.pinned)):
            if flag:
                names.add(name)
            else:
                names.discard(name)

    def estimate(self, name: str, version: int, version_dir: Path, instances: int) -> int:
        known = self._costs.get((name, version))
        if known is not None:
            return known
        return floor_bytes(version_dir, instances)

    # -- reserve / settle / release ----------------------------------------------------------------
    async def reserve(
        self, name: str, version: int, nbytes: int, evictable: Callable[[str], bool],
        evict: Callable[[str], Awaitable[None]],
    ) -> Charge:  # fmt: skip
        """Hold `nbytes` for a load of `name`, evicting LRU models first when the budget needs it.
        Reservations are serialised, so two loads never both count on the same free memory."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.budget_bytes is not None:
                await self._make_room(name, nbytes, evictable, evict)
            charge = Charge(name, version, nbytes)
            self._pending.add(charge)
            return charge

    async def _make_room(
        self, name: str, nbytes: int, evictable: Callable[[str], bool],
        evict: Callable[[str], Awaitable[None]],
    ) -> None:  # fmt: skip
        assert self.budget_bytes is not None
        tried: set[str] = set()
        deadline = time.monotonic() + self.room_wait_s
        while True:
            need = self.used() + nbytes - self.budget_bytes
            resident = {n: b for n, b in self.resident().items() if n != name and n not in tried}
            victims = choose_victims(resident, self.last_used, need, lambda n: self._can_go(n, evictable))
            if victims is None:
                # Loads in progress (not evictable yet) or busy models may free their claim soon.
                waitable = self._pending or any(n not in self.pinned for n in resident)
                if not waitable or time.monotonic() >= deadline or nbytes > self.budget_bytes:
                    raise self._exhausted(name, nbytes, evictable)
                await asyncio.sleep(ROOM_POLL_S)
                continue
            if not victims:
                return
            victim = victims[0]
            tried.add(victim)  # bounded: each resident model is tried at most once
            log.info("memory budget: unloading %s (least recently used, %.1f MiB) to load %s (%.1f MiB)",
                     victim, resident[victim] / MIB, name, nbytes / MIB)  # fmt: skip
            try:
                await evict(victim)
            except Exception:
                log.exception("memory budget: unloading %s failed", victim)
                continue
            self.evictions[victim] += 1

    async def trim(
        self, name: str, evictable: Callable[[str], bool], evict: Callable[[str], Awaitable[None]]
    ) -> None:
        """After a load measured more than its estimate: evict LRU models (never `name`) until the
        resident models fit the budget again, as far as idle unpinned models allow."""
        if self.budget_bytes is None or self.used() <= self.budget_bytes:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            tried: set[str] = {name}
            while self.used() > self.budget_bytes:
                resident = {n: b for n, b in self.resident().items() if n not in tried}
                need = self.used() - self.budget_bytes
                victims = choose_victims(resident, self.last_used, need, lambda n: self._can_go(n, evictable))
                if not victims:
                    log.warning("memory budget: models hold %.1f MiB of %.1f MiB; none can unload now",
                                self.used() / MIB, self.budget_bytes / MIB)  # fmt: skip
                    return
                tried.add(victims[0])
                try:
                    await evict(victims[0])
                except Exception:
                    log.exception("memory budget: unloading %s failed", victims[0])
                    continue
                self.evictions[victims[0]] += 1

    def _can_go(self, name: str, evictable: Callable[[str], bool]) -> bool:
        return name not in self.pinned and evictable(name)

    def _exhausted(self, name: str, nbytes: int, evictable: Callable[[str], bool]) -> InferenceError:
        assert self.budget_bytes is not None
        held = []
        for other, cost in sorted(self.resident().items()):
            why = "pinned" if other in self.pinned else "busy" if not evictable(other) else "evictable"
            held.append(f"{other} {cost / MIB:.1f} MiB ({why})")
        loading = sum(c.nbytes for c in self._pending)
        if loading:
            held.append(f"{loading / MIB:.1f} MiB reserved by loads in progress")
        return InferenceError(
            Status.RESOURCE_EXHAUSTED,
            f"failed to load '{name}': it needs about {nbytes / MIB:.1f} MiB and the memory budget is "
            f"{self.budget_bytes / MIB:.1f} MiB ({self.budget_reason}), with "
            f"{self.used() / MIB:.1f} MiB held: {', '.join(held) or 'nothing'}; raise "
            "[repository] memory_budget_mb, unpin or unload a model, or wait until busy models are idle",
        )

    def measured(self, charge: Charge, rss_growth: int, floor: int) -> None:
        """Record what a finished load cost: the RSS growth, never below `floor` (file-size based)."""
        charge.nbytes = max(rss_growth, floor)
        if len(self._costs) >= MAX_REMEMBERED:
            self._costs.pop(next(iter(self._costs)))
        self._costs[(charge.name, charge.version)] = charge.nbytes

    def settle(self, charge: Charge, served: object) -> None:
        """The load succeeded: `served` holds the charge until `release(served)`."""
        self._pending.discard(charge)
        self._charges[id(served)] = charge
        self.evicted.discard(charge.name)
        self.touch(charge.name)  # just loaded: most recently used

    def cancel(self, charge: Charge) -> None:
        self._pending.discard(charge)

    def release(self, served: object) -> None:
        self._charges.pop(id(served), None)

    def grow(self, served: object, nbytes: int) -> None:
        """A loaded version grew (an instance added) or shrank (negative) by `nbytes`."""
        charge = self._charges.get(id(served))
        if charge is not None:
            charge.nbytes = max(0, charge.nbytes + nbytes)

    def charge_of(self, served: object) -> Charge | None:
        return self._charges.get(id(served))

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self.evicted.discard(name)
