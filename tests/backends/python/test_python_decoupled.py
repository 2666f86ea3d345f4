"""Decoupled Python models and async execute on real worker processes, driven as the scheduler drives
them (`infer_decoupled` with one ResponseSink per request): responses sent from a model thread after
execute returned, in order and ending with one final; concurrent async executes; a send after the
final flag refused in the model's log and reaching nobody; a model that never ends its request until
it sees the cancellation; a flood of responses to a reader that stops, holding the sender (bounded)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pymodels import write_model
from streammodels import AFTER_FINAL, DECOUPLED_CONFIG, FLOOD, REPEAT, SQUARE_ASYNC, UNTIL_CANCELLED

from edgeserve.backends.base import BackendOptions, RequestInfo, get_backend
from edgeserve.backends.python.backend import PythonBackend
from edgeserve.backends.python.instance import PythonInstance
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.config import parse_pbtxt

pytestmark = pytest.mark.timeout(180)
WAIT_S = 60.0  # generous: a loaded 2-core box starts workers slowly; nothing here measures speed


class Sink:
    """A ResponseSink as the data plane's: collects, refuses after final, can block (a slow reader)."""

    def __init__(self, hold_after: int | None = None) -> None:
        self.responses: list[dict[str, Any]] = []
        self.errors: list[InferenceError] = []
        self.finals = 0
        self.done = threading.Event()
        self.held = threading.Event()  # the reader stopped reading (hold_after reached)
        self.release = threading.Event()
        self.hold_after = hold_after
        self._cancelled = False
        self._lock = threading.Lock()

    def send(
        self, outputs: Mapping[str, Any] | None, *, final: bool = False, error: InferenceError | None = None
    ) -> None:
        with self._lock:
            if self.finals:
                raise InferenceError(Status.INTERNAL, "a response after the final one")
            if outputs is not None:
                self.responses.append({k: np.array(v) for k, v in outputs.items()})
            if error is not None:
                self.errors.append(error)
            if final:
                self.finals += 1
                self.done.set()
            count = len(self.responses)
        if self.hold_after is not None and count >= self.hold_after and not final:
            self.held.set()
            self.release.wait(WAIT_S)

    def cancel(self) -> None:
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


@pytest.fixture
def load(tmp_path: Path) -> Iterator[Any]:
    backend = get_backend("python")
    assert isinstance(backend, PythonBackend)
    made: list[PythonInstance] = []

    def factory(name: str, source: str) -> PythonInstance:
        path = write_model(tmp_path / "repo", name, source, DECOUPLED_CONFIG.format(name=name))
        raw = parse_pbtxt(path.parent.parent / "config.pbtxt")
        _, config = backend.inspect_config(path, raw, "test", BackendOptions())
        instance = backend.load(path, config, BackendOptions())
        made.append(instance)
        return instance

    yield factory
    for instance in made:
        instance.close()


def _run(instance: PythonInstance, values: list[int], sink: Sink) -> None:
    instance.infer_decoupled([{"IN": np.array(values, dtype=np.int32)}], [RequestInfo()], [sink])


def test_repeat_sends_each_response_in_order_after_execute_returned(load: Any) -> None:
    instance = load("repeat", REPEAT)
    sinks = [Sink(), Sink()]
    instance.infer_decoupled(
        [{"IN": np.array([4, 2, 0, 1], np.int32)}, {"IN": np.array([], np.int32)}],
        [RequestInfo(), RequestInfo()], sinks,
    )  # fmt: skip
    for sink in sinks:
        assert sink.done.wait(WAIT_S)
    assert not sinks[0].errors, sinks[0].errors
    assert [int(r["OUT"][0]) for r in sinks[0].responses] == [4, 2, 0, 1]
    assert [int(r["IDX"][0]) for r in sinks[0].responses] == [0, 1, 2, 3]
    assert sinks[0].finals == 1 and not sinks[0].errors
    assert sinks[1].responses == [] and sinks[1].finals == 1  # zero responses: the final flag alone


def test_unary_calls_to_a_decoupled_model_get_tritons_error(load: Any) -> None:
    instance = load("repeat_unary", REPEAT)
    with pytest.raises(InferenceError, match="decoupled transaction policy"):
        instance.infer({"IN": np.array([1], np.int32)})


def test_async_execute_runs_requests_concurrently(load: Any) -> None:
    instance = load("square_async", SQUARE_ASYNC)
    together = 4
    sinks = [Sink() for _ in range(together)]
    for count, sink in enumerate(sinks, start=1):
        # Each call returns while its coroutine waits for the others: one instance, 4 in flight.
        _run(instance, [count, together], sink)
    for count, sink in enumerate(sinks, start=1):
        assert sink.done.wait(WAIT_S), f"request {count} never ended: executes did not overlap"
        assert [int(r["OUT"][0]) for r in sink.responses] == [count * count] * count
        assert sink.finals == 1


def test_send_after_final_is_refused_in_the_models_log_and_reaches_nobody(
    load: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    instance = load("after_final", AFTER_FINAL)
    sink = Sink()
    _run(instance, [1], sink)
    assert sink.done.wait(WAIT_S)
    instance.close()  # the worker's log is flushed by then
    err = capfd.readouterr().err
    assert "Response sender has been closed" in err and "second send refused" in err
    assert len(sink.responses) == 1 and sink.finals == 1 and not sink.errors


def test_a_model_that_never_ends_sees_the_cancellation(load: Any) -> None:
    instance = load("until_cancelled", UNTIL_CANCELLED)
    sink = Sink()
    _run(instance, [0], sink)
    assert not sink.done.is_set()
    sink.cancel()  # the client went away / its deadline passed
    assert sink.done.wait(WAIT_S), "the model never saw request.is_cancelled()"
    assert sink.finals == 1


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_flood_to_a_reader_that_stops_holds_the_sender(load: Any) -> None:
    """10^6 responses asked for; the reader stops after 2000. The model's send waits for the server's
    answer, so nothing queues: while the reader holds, the worker's memory stays where it was and the
    server has one response in hand; cancelling ends the flood."""
    instance = load("flood", FLOOD)
    pid = instance.pid
    assert pid is not None
    sink = Sink(hold_after=2000)
    # This model sends from execute() itself, so the call returns only when the flood ends.
    caller = threading.Thread(target=_run, args=(instance, [10**6], sink))
    caller.start()
    assert sink.held.wait(WAIT_S)
    before = _rss_kib(pid)
    # The model keeps trying: were sends queued, the worker (or the server) would grow by ~100 bytes
    # per response; give it the time of many responses (it blocks instead).
    threading.Event().wait(1.0)
    after = _rss_kib(pid)
    assert len(sink.responses) == 2000
    assert after - before < 4096, f"the worker grew by {after - before} KiB while the reader held"
    sink.cancel()
    sink.release.set()
    assert sink.done.wait(WAIT_S)
    caller.join(WAIT_S)
    assert 2000 <= len(sink.responses) <= 2001 and sink.finals == 1
