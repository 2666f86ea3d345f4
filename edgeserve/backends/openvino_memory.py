"""What an OpenVINO compiled model holds, and giving its intermediate buffers back when it is idle.

The CPU plugin keeps the intermediate buffers of the largest shape a compiled model has run (a dynamic
-shape model such as PP-OCR det held ~70 MB after 960x960 inputs) until `CompiledModel.release_memory()`;
the next call allocates them again. `IdleRelease` calls it once a model has been idle for the memory
profile's `ov_release_idle_s` (one thread for the process), or after every call when that is 0, never
while a call runs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from edgeserve.backends.watch_thread import WatchThread

log = logging.getLogger("edgeserve.backends.openvino")

_PRECISION_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4,
                    "u32": 4, "i64": 8, "u64": 8, "boolean": 1, "u1": 1, "i4": 1, "u4": 1}  # fmt: skip
POLL_S = 1.0  # the releasing thread looks this often (at least)


def weights_bytes(compiled: Any) -> int:
    """The constants of the compiled graph at their runtime precision (bf16: half the f32 size): an
    estimate of the weights the plugin holds. 0 when the runtime model cannot be read."""
    total = 0
    try:
        for op in compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            if "layerType" not in info or info["layerType"].astype(str) != "Const":
                continue
            precisions = info["outputPrecisions"].astype(str) if "outputPrecisions" in info else ""
            precision = precisions.split(",")[0]
            for output in op.outputs():
                shape = output.get_partial_shape()
                if not shape.is_static:
                    continue
                count = 1
                for dim in shape.to_shape():
                    count *= int(dim)
                total += count * _PRECISION_BYTES.get(precision.lower(), output.get_element_type().size)
    except Exception as exc:  # an estimate: a plugin without a runtime model just reports none
        log.debug("no runtime model to measure: %s", exc)
        return 0
    return total


class IdleRelease:
    """Holds `busy` around each call; releases the compiled model's buffers when it has been idle,
    and `renew()`s the instance's infer request, which holds its last input (shared with the caller's
    array) and output tensors: a frame and a score map per model, otherwise kept until the next call."""

    def __init__(self, compiled: Any, idle_s: float, renew: Callable[[], None] = lambda: None) -> None:
        self.compiled = compiled
        self.renew = renew
        self.idle_s = idle_s
        self.busy = threading.Lock()
        self.used_at = 0.0
        self.dirty = False  # buffers allocated since the last release
        self.releases = 0

    def after_call(self) -> None:
        """Called with `busy` held, after the outputs were copied out."""
        if self.idle_s == 0:
            self._release()
            return
        self.used_at = time.monotonic()
        if not self.dirty and self.idle_s > 0:
            self.dirty = True
            _watcher.add(self)

    def release_if_idle(self, now: float) -> bool:
        """True when this no longer needs watching (released, or closed)."""
        if self.compiled is None or not self.dirty:
            return True
        if now - self.used_at < self.idle_s or not self.busy.acquire(blocking=False):
            return False
        try:
            if self.compiled is not None and self.dirty and time.monotonic() - self.used_at >= self.idle_s:
                self._release()
            return not self.dirty
        finally:
            self.busy.release()

    def _release(self) -> None:
        with contextlib.suppress(Exception):  # an older openvino without release_memory: keep serving
            self.renew()
            self.compiled.release_memory()
            self.releases += 1
        self.dirty = False

    def close(self) -> None:
        with self.busy:
            self.compiled = None
            self.dirty = False


class _Watcher(WatchThread["IdleRelease"]):
    """One daemon thread for the process, alive while some compiled model waits for its release."""

    def _run(self) -> None:
        while True:
            with self._lock:
                items = list(self._items)
                if not items:
                    self._thread = None
                    return
            wait = min([POLL_S, *(max(0.05, i.idle_s) for i in items)])
            time.sleep(wait)
            now = time.monotonic()
            for item in items:
                if item.release_if_idle(now):
                    with self._lock:
                        if not item.dirty:
                            self._items.discard(item)


_watcher = _Watcher("edgeserve-ov-release")
