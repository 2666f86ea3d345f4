"""Response cache (Triton's `response_cache { enable: true }` with `--cache-config local,size=N`).

One server-wide LRU, bounded in bytes by `[server] cache_mb`, shared by every model whose config
enables it. A key is a SHA-256 digest over, each field length-prefixed: the served model
version's identity (name, version and a token unique to that load), every input's name, datatype,
shape and exact bytes, the requested output names, and the request's custom parameters (a Python
model reads them with `request.parameters()`; each with its type, so 1, 1.0, "1" and true differ).
The request ID is not in the key: a model whose answer depends on it must not enable the cache.
Different inputs never share an entry (a 256-bit digest collision is not a practical event, even
for a client that tries; SHA-256 rather than BLAKE2b because CPUs with SHA extensions hash a camera
frame 3-4x faster). Only the requested outputs are stored, as read-only copies: a response served
from the cache can never see another request's buffer change, and a client cannot change a cached
entry. Classification and shared-memory writes are applied per request afterwards, so they need no
place in the key.

Not cached: models without `response_cache.enable`, models with a sequence batcher, requests that
carry sequence parameters, and errors. A reload or unload of a model makes a new token: the old
version's entries can no longer be hit and are purged when that version is released.

Statistics: `cache_hit` / `cache_miss` durations in the model's InferStatistics (a hit counts in
`success` and `queue` but not in `inference_count` / `execution_count`, as in Triton), per-model
Prometheus counters (metrics.py) and the cache-wide gauges of `CacheCollector`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgeserve.scheduling.job import Arrays, JobCallback

log = logging.getLogger("edgeserve.cache")

MIB = 1024 * 1024
ENTRY_OVERHEAD_BYTES = 256  # key, dict slots and array headers of one entry, roughly
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")
# Parameters that never change an answer (sequence requests are not cached at all).
_NOT_IN_KEY = frozenset(SEQUENCE_PARAMETERS)


class CacheStats(Protocol):
    def record_cache_hit(self, request_ns: int, lookup_ns: int) -> None: ...
    def record_cache_miss(self, lookup_ns: int) -> None: ...


class CachedModel(Protocol):
    name: str
    version: int
    config: Any
    stats: Any  # ModelStats (weak-referenceable; one per loaded version)


def cache_enabled(config: Any) -> bool:
    """The model asks for the cache, is stateless and answers once per request."""
    return (
        bool(config.response_cache.enable)
        and not config.HasField("sequence_batching")
        and not config.model_transaction_policy.decoupled
    )


def has_sequence(parameters: Mapping[str, Any]) -> bool:
    return parameters.get("sequence_id") not in (None, 0, "") or any(
        parameters.get(key) for key in SEQUENCE_PARAMETERS[1:]
    )


def nbytes(array: npt.NDArray[Any]) -> int:
    if array.dtype == np.object_:
        return sum(len(x) if isinstance(x, (bytes, str)) else 8 for x in array.reshape(-1)) + 8 * array.size
    return int(array.nbytes)


def _field(digest: Any, data: bytes) -> None:
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def request_key(token: int, name: str, version: int, inputs: Arrays, outputs: Sequence[str],
                parameters: Mapping[str, Any] | None = None) -> bytes:  # fmt: skip
    """SHA-256 over the model identity, every input (name, dtype, shape, bytes), the outputs and the
    custom parameters."""
    digest = hashlib.sha256()
    digest.update(token.to_bytes(8, "little"))
    _field(digest, name.encode())
    digest.update(int(version).to_bytes(8, "little", signed=True))
    digest.update(len(inputs).to_bytes(8, "little"))
    for input_name in sorted(inputs):
        array = inputs[input_name]
        _field(digest, input_name.encode())
        _field(digest, array.dtype.str.encode())
        _field(digest, b",".join(str(d).encode() for d in array.shape))
        if array.dtype == np.object_:
            for item in array.reshape(-1):
                _field(digest, item if isinstance(item, bytes) else str(item).encode())
        else:
            data = np.ascontiguousarray(array)
            digest.update(data.nbytes.to_bytes(8, "little"))
            digest.update(data.view(np.uint8).reshape(-1).data if data.size else b"")
    digest.update(len(outputs).to_bytes(8, "little"))
    for output in sorted(outputs):
        _field(digest, output.encode())
    custom = sorted(
        (k, v) for k, v in (parameters or {}).items() if k not in _NOT_IN_KEY and not k.startswith("triton_")
    )
    digest.update(len(custom).to_bytes(8, "little"))
    for key, value in custom:
        _field(digest, key.encode())
        _field(digest, f"{type(value).__name__}:{value!r}".encode())
    return digest.digest()


def frozen_copy(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    copy = np.array(array, copy=True, order="C")
    copy.flags.writeable = False
    return copy


@dataclass(slots=True)
class _Entry:
    outputs: dict[str, npt.NDArray[Any]]
    size: int
    token: int


@dataclass(frozen=True, slots=True)
class CacheCounters:
    entries: int
    bytes: int
    capacity: int
    hits: int
    misses: int
    evictions: int
    inserts: int


class CacheTicket:
    """One cacheable request: `outputs` is set on a hit (already counted); on a miss `wrap` the job's
    callback so a successful result is stored."""

    __slots__ = ("_cache", "_key", "_model", "_names", "_token", "lookup_ns", "outputs")

    def __init__(self, cache: ResponseCache, key: bytes, token: int, model: CachedModel, lookup_ns: int,
                 names: Sequence[str], outputs: Arrays | None) -> None:  # fmt: skip
        self._cache = cache
        self._key = key
        self._token = token
        self._model = model
        self.lookup_ns = lookup_ns
        self._names = list(names)
        self.outputs = outputs

    def wrap(self, done: JobCallback) -> JobCallback:
        def store(result: Arrays | BaseException) -> None:
            if not isinstance(result, BaseException):
                start = time.monotonic_ns()
                try:
                    self._cache.insert(
                        self._key, self._token, {n: result[n] for n in self._names if n in result}
                    )
                except Exception:  # never fail a good answer because the cache could not keep it
                    log.exception("response cache: storing an entry of %s failed", self._model.name)
                self._model.stats.record_cache_miss(self.lookup_ns + time.monotonic_ns() - start)
            done(result)

        return store


class ResponseCache:
    """Thread-safe LRU of model outputs, bounded by `capacity_bytes` (0 = off)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = max(0, int(capacity_bytes))
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._by_token: dict[int, set[bytes]] = {}
        self._tokens: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next_token = itertools.count(1)
        self._live: set[int] = set()  # tokens of model versions still loaded
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._inserts = 0
        self._warned: set[str] = set()
        self.collector = CacheCollector(self)

    # -- the data plane's entry point ----------------------------------------------------------------
    def begin(self, model: CachedModel, parameters: Mapping[str, Any], inputs: Arrays,
              output_names: Sequence[str]) -> CacheTicket | None:  # fmt: skip
        """None when this request is not cacheable; else a ticket (a hit has `outputs`)."""
        if not cache_enabled(model.config) or has_sequence(parameters):
            return None
        if self.capacity == 0:
            if model.name not in self._warned:
                self._warned.add(model.name)
                log.warning(
                    "model %s enables response_cache but [server] cache_mb is 0: not caching", model.name
                )
            return None
        start = time.monotonic_ns()
        token = self._token(model.stats)
        key = request_key(token, model.name, model.version, inputs, output_names, parameters)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
            else:
                self._entries.move_to_end(key)
                self._hits += 1
        lookup_ns = time.monotonic_ns() - start
        if entry is None:
            return CacheTicket(self, key, token, model, lookup_ns, output_names, None)
        return CacheTicket(self, key, token, model, lookup_ns, output_names, dict(entry.outputs))

    def _token(self, owner: Any) -> int:
        token = self._tokens.get(owner)
        if token is None:
            with self._lock:
                token = self._tokens.get(owner)
                if token is None:
                    token = next(self._next_token)
                    self._tokens[owner] = token
                    self._live.add(token)
                    weakref.finalize(owner, self._purge, token)
        return token

    # -- storage -------------------------------------------------------------------------------------
    def lookup(self, key: bytes) -> dict[str, npt.NDArray[Any]] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return dict(entry.outputs)

    def insert(self, key: bytes, token: int, outputs: Mapping[str, npt.NDArray[Any]]) -> bool:
        """Store read-only copies; False when the entry alone exceeds the capacity."""
        size = (
            ENTRY_OVERHEAD_BYTES + len(key) + sum(nbytes(np.asarray(a)) + len(n) for n, a in outputs.items())
        )
        if size > self.capacity:
            return False
        copies = {name: frozen_copy(np.asarray(array)) for name, array in outputs.items()}
        with self._lock:
            if token not in self._live:
                return False  # the model version was released meanwhile
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            while self._entries and self._bytes + size > self.capacity:
                evicted_key, evicted = self._entries.popitem(last=False)
                self._forget(evicted_key, evicted)
                self._evictions += 1
            self._entries[key] = _Entry(copies, size, token)
            self._by_token.setdefault(token, set()).add(key)
            self._bytes += size
            self._inserts += 1
        return True

    def _forget(self, key: bytes, entry: _Entry) -> None:  # lock held; entry already out of _entries
        self._bytes -= entry.size
        keys = self._by_token.get(entry.token)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_token[entry.token]

    def _purge(self, token: int) -> None:
        """Drop every entry of a released model version."""
        with self._lock:
            self._live.discard(token)
            for key in self._by_token.pop(token, set()):
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self._bytes -= entry.size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_token.clear()
            self._bytes = 0

    def counters(self) -> CacheCounters:
        with self._lock:
            return CacheCounters(len(self._entries), self._bytes, self.capacity, self._hits, self._misses,
                                 self._evictions, self._inserts)  # fmt: skip


class CacheCollector(Collector):
    """Triton's cache-wide metrics (nv_cache_*) plus the bytes held."""

    def __init__(self, cache: ResponseCache) -> None:
        self._cache = weakref.ref(cache)

    def collect(self) -> Iterator[Metric]:
        cache = self._cache()
        if cache is None:
            return
        c = cache.counters()
        yield GaugeMetricFamily("nv_cache_num_entries", "Number of responses stored in response cache",
                                value=c.entries)  # fmt: skip
        yield GaugeMetricFamily("nv_cache_util", "Response cache utilization [0.0 - 1.0]",
                                value=c.bytes / c.capacity if c.capacity else 0.0)  # fmt: skip
        yield GaugeMetricFamily("edgeserve_cache_bytes", "Bytes held by the response cache", value=c.bytes)
        yield GaugeMetricFamily("edgeserve_cache_capacity_bytes", "Response cache bound ([server] cache_mb)",
                                value=c.capacity)  # fmt: skip
        # Gauges polled from the cache, as Triton exports them.
        for name, help_text, value in (
            ("nv_cache_num_lookups", "Number of response cache lookups", c.hits + c.misses),
            ("nv_cache_num_hits", "Number of response cache hits", c.hits),
            ("nv_cache_num_misses", "Number of response cache misses", c.misses),
            ("nv_cache_num_evictions", "Number of response cache evictions", c.evictions),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
