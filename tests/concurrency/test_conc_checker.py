"""The suite's own generators and checkers, without a server: plans are fixed by their seed, every
request is told apart from every other, the references equal what the real model files compute (ONNX
Runtime on the files the suite writes), and the checker flags each kind of wrong answer a broken
server could give (a misrouted row, a padding slot's answer, another sequence's CORRID, a lost
answer, an answer from a version that was not serving), naming the seed, client and request."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import conc_wires
import numpy as np
import onnxruntime as ort
import pytest
from conc_check import Checker
from conc_models import RELOADABLE, STATELESS, AffineModel, Array, build_affine
from conc_plans import Expect, Mix, Op, client_ops, identity_row
from conc_seq_models import CORRID_TYPES, SEQUENCES, Flag, SeqModel, build_sequence
from conc_transports import Answer, Call, Endpoints, Transport
from conc_wires import TRANSPORTS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workload import run_clients

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NOWHERE = Endpoints("127.0.0.1:1", "127.0.0.1:1", "ipc:///nonexistent")
FLAT = [m for m in STATELESS if not m.ensemble]


# -- plans ----------------------------------------------------------------------------------------------
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), client=st.integers(0, 63))
def test_a_seed_fixes_the_plan(seed: int, client: int) -> None:
    mix = Mix(stateless=STATELESS, sequences=SEQUENCES)
    first = list(itertools.islice(client_ops(seed, 0, client, mix), 12))
    again = list(itertools.islice(client_ops(seed, 0, client, mix), 12))
    for a, b in zip(first, again, strict=True):
        assert (a.think_s, a.pipelined, a.transport) == (b.think_s, b.pipelined, b.transport)
        for ca, cb in zip(a.calls, b.calls, strict=True):
            assert (ca.model, ca.request_id, ca.sequence_id, ca.start, ca.end) == (
                cb.model,
                cb.request_id,
                cb.sequence_id,
                cb.start,
                cb.end,
            )
            for name in ca.inputs:
                np.testing.assert_array_equal(ca.inputs[name], cb.inputs[name])


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_requests_are_told_apart(seed: int) -> None:
    """Request ids never repeat, fresh stateless rows never repeat, and a sequence ID is only reused by
    the client that owns it (after its END)."""
    mix = Mix(stateless=STATELESS, sequences=SEQUENCES, p_repeat=0.0)
    ids: set[str] = set()
    rows: set[tuple[float, ...]] = set()
    owners: dict[tuple[str, int | str], int] = {}
    for client in range(8):
        for op in itertools.islice(client_ops(seed, 3, client, mix), 10):
            for call in op.calls:
                assert call.request_id not in ids
                ids.add(call.request_id)
                if call.sequence_id:
                    key = (call.model, call.sequence_id)
                    assert owners.setdefault(key, client) == client
                else:
                    for row in call.inputs["X"]:
                        assert tuple(row) not in rows
                        rows.add(tuple(row))


@SETTINGS
@given(run=st.integers(0, 63), client=st.integers(0, 127), number=st.integers(0, 2**17 - 1))
def test_sequence_ids_fit_their_corrid_type(run: int, client: int, number: int) -> None:
    limits = {"uint64": (1, 2**64), "int64": (1, 2**63), "uint32": (1, 2**32), "int32": (1, 2**31)}
    for corrid in CORRID_TYPES:
        seq = SeqModel("s", "onnxruntime", "direct", (), corrid)
        for wide in (True, False):
            sid = seq.sequence_id(5, run, client, number, wide)
            if corrid == "string":
                assert isinstance(sid, str) and sid
                continue
            low, high = limits[corrid] if wide else (1, 2**63)
            assert isinstance(sid, int) and low <= sid < high
            assert np.array(sid, dtype=CORRID_TYPES[corrid][1]).item() == sid


# -- references against the real model files -------------------------------------------------------------
@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("conc_refs")
    out: dict[str, Any] = {}
    for model in [*FLAT, *RELOADABLE]:
        path = build_affine(tmp / f"{model.name}.onnx", model.k, model.c)
        out[model.name] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for seq in SEQUENCES:
        path = build_sequence(tmp / f"{seq.name}.onnx", seq)
        out[seq.name] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return out


@SETTINGS
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 4095), st.integers(0, 2**20 - 1), st.integers(0, 7), st.integers(0, 2**20 - 1)
        ),
        min_size=1,
        max_size=8,
    )
)
def test_stateless_references_equal_the_model_files(
    sessions: dict[str, Any], rows: list[tuple[int, ...]]
) -> None:
    x = np.array([identity_row(*r) for r in rows], np.float32)
    for model in [*FLAT, *RELOADABLE]:
        got = sessions[model.name].run(["Y"], {"X": x})[0]
        np.testing.assert_array_equal(got, model.expected(x), err_msg=model.name)
        np.testing.assert_array_equal(np.rint(model.decode(got)), x)  # a wrong answer decodes to its owner
    ensemble = next(m for m in STATELESS if m.ensemble)
    chained = ((x + np.float32(ensemble.pre)) * np.float32(ensemble.k) + np.float32(ensemble.c)) * np.float32(
        2
    )
    np.testing.assert_array_equal(ensemble.expected(x), chained)


def _control_feed(seq: SeqModel, rows: Sequence[tuple[bool, bool, int | str]]) -> dict[str, Array]:
    feed: dict[str, Array] = {}
    shape = (len(rows), 1) if seq.max_batch else (1,)
    for flag in seq.flags:
        dtype = {"int32": np.int32, "fp32": np.float32, "bool": np.bool_}[flag.dtype]
        on = [{"START": s, "END": e, "READY": True}[flag.kind] for s, e, _ in rows]
        feed[flag.kind] = np.array([flag.value(v) for v in on]).astype(dtype).reshape(shape)
    if seq.corrid:
        # onnxruntime takes strings as str (bytes would arrive as their repr)
        values = [str(sid) if seq.corrid == "string" else seq.corrid_value(sid) for _, _, sid in rows]
        feed["CORRID"] = np.array(values, dtype=CORRID_TYPES[seq.corrid][1]).reshape(shape)
    return feed


@pytest.mark.parametrize("seq", [s for s in SEQUENCES if s.backend == "onnxruntime"], ids=lambda s: s.name)
def test_sequence_model_files_echo_what_the_checker_expects(sessions: dict[str, Any], seq: SeqModel) -> None:
    """The ONNX sequence model fed the way the server feeds it (controls and state) answers what the
    checker accepts; fed the wrong control values, it answers what the checker rejects."""
    sid = seq.sequence_id(1, 2, 3, 4)
    shape = seq.input_shape()
    state = np.zeros(shape, np.float32)
    total = 0.0
    names = [o.name for o in sessions[seq.name].get_outputs()]
    for step, value in enumerate((5.0, 7.0, 11.0)):
        total += value
        feed = {
            "INPUT": np.full(shape, value, np.float32),
            "STATE_IN": state,
            **_control_feed(seq, [(step == 0, step == 2, sid)]),
        }
        outputs = dict(zip(names, sessions[seq.name].run(None, feed), strict=True))
        state = outputs.pop("STATE_OUT")
        op = Op(
            0,
            0,
            "grpc",
            0.0,
            False,
            [Call(seq.name, {}, seq.outputs, "r")],
            [Expect(seq, step=step, length=3, total=total, sequence_id=sid)],
        )
        assert Checker(1).check(op, [Answer(outputs)]) == []
        swapped = dict(
            zip(
                names,
                sessions[seq.name].run(None, {**feed, **_control_feed(seq, [(step != 0, step != 2, sid)])}),
                strict=True,
            )
        )
        swapped.pop("STATE_OUT")
        kinds = {m.kind for m in Checker(1).check(op, [Answer(swapped)])}
        flagged = {f.kind for f in seq.flags if f.kind != "READY" and f.value(True) != f.value(False)}
        assert ("control" in kinds) == bool(flagged), kinds


# -- the checker against a server that gets things wrong ---------------------------------------------------
class FakeServer:
    """The models' semantics in-process (the reference), with one fault switched on: `swap` answers a
    stateless call with the answer of the call before it (anyone's), `padding` answers a sequence step
    as an empty Direct slot (READY false, zeros, no CORRID), `other_sequence` with the state and CORRID
    of another sequence, `lost` drops every 50th answer, `rows` reverses multi-row answers, `rid` gives a
    Python model's row the request ID of the request before it."""

    def __init__(self, fault: str = "") -> None:
        self.fault = fault
        self.lock = threading.Lock()
        self.models: dict[str, AffineModel | SeqModel] = {m.name: m for m in (*STATELESS, *SEQUENCES)}
        self.states: dict[tuple[str, int | str], float] = {}
        self.seen: dict[tuple[str, int | str], float] = {}  # every sequence's latest sum, ended ones too
        self.previous: Array | None = None
        self.previous_id = ""
        self.calls = 0

    def answer(self, call: Call) -> Answer:
        with self.lock:
            self.calls += 1
            if self.fault == "lost" and self.calls % 50 == 0:
                return Answer(error="no answer", lost=True)
            model = self.models[call.model]
            if isinstance(model, SeqModel):
                return self._step(model, call)
            y = model.expected(call.inputs["X"])
            if self.fault == "swap" and self.previous is not None and self.calls % 7 == 0:
                y, self.previous = self.previous, y
            else:
                self.previous = y
            if self.fault == "rows" and len(y) > 1:
                y = y[::-1]
            outputs = {"Y": y}
            if "RID" in call.outputs:
                rid, self.previous_id = self.previous_id, call.request_id
                if self.fault != "rid" or not rid:
                    rid = call.request_id
                outputs["RID"] = np.full((len(y), 1), rid.encode(), dtype=np.object_)
            return Answer(outputs, response_id=call.request_id, model_version="1")

    def _step(self, seq: SeqModel, call: Call) -> Answer:
        key = (seq.name, call.sequence_id)
        total = (0.0 if call.start else self.states[key]) + float(call.inputs["INPUT"].reshape(-1)[0])
        self.states[key] = total
        if call.end:
            del self.states[key]
        flags = {"START": call.start, "END": call.end, "READY": True}
        corrid: Any = seq.corrid_value(call.sequence_id)
        others = [k for k in self.seen if k[0] == seq.name and k != key]
        self.seen[key] = total
        if self.fault == "padding" and self.calls % 5 == 0:
            total, flags, corrid = 0.0, dict.fromkeys(flags, False), b"" if seq.corrid == "string" else 0
        elif self.fault == "other_sequence" and others and self.calls % 5 == 0:
            total, corrid = self.seen[others[-1]], seq.corrid_value(others[-1][1])
        shape = seq.input_shape()
        outputs: dict[str, Array] = {"OUTPUT": np.full(shape, total, np.float32)}
        for flag in seq.flags:
            outputs[f"ECHO_{flag.kind}"] = np.full(shape, np.float32(flag.value(flags[flag.kind])))
            if flag.dtype == "bool":
                outputs[f"ECHO_{flag.kind}"] = np.full(shape, np.float32(bool(flag.value(flags[flag.kind]))))
        if seq.corrid:
            outputs["ECHO_CORRID"] = np.full(shape, corrid, dtype=CORRID_TYPES[seq.corrid][1])
        if seq.backend == "python":
            outputs["ROWS"] = np.ones(shape, np.int32)
            outputs["REQ_FLAGS"] = np.full(shape, int(call.start) | 2 * int(call.end), np.int32)
            outputs["REQ_CORRID"] = np.full(shape, str(call.sequence_id).encode(), dtype=np.object_)
        return Answer(outputs, response_id=call.request_id)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeServer]:
    server = FakeServer()

    class FakeTransport(Transport):
        def run(self, calls: Sequence[Call], pipelined: bool) -> list[Answer]:
            return [server.answer(call) for call in calls]

    for name in TRANSPORTS:
        monkeypatch.setitem(conc_wires.FACTORIES, name, FakeTransport)
    yield server


MIX = Mix(stateless=STATELESS, sequences=SEQUENCES, max_think_ms=0.0, p_sequence=0.4)


def test_a_correct_server_passes(fake: FakeServer) -> None:
    report = run_clients(NOWHERE, 9, 16, MIX, ops_per_client=15)
    assert report.ok, report.render()
    assert report.ops == 16 * 15 and report.requests == fake.calls


@pytest.mark.parametrize(
    ("fault", "kinds"),
    [
        ("swap", {"value"}),
        ("rows", {"value"}),
        ("padding", {"value", "control", "corrid"}),
        ("other_sequence", {"value", "corrid"}),
        ("lost", {"lost"}),
        ("rid", {"request_id"}),
    ],
)
def test_each_fault_is_caught_and_named(fake: FakeServer, fault: str, kinds: set[str]) -> None:
    fake.fault = fault
    report = run_clients(NOWHERE, 9, 16, MIX, ops_per_client=15)
    assert not report.ok
    assert kinds <= set(report.by_kind), report.summary()
    text = report.render(replay="EDGESERVE_CONC_SEEDS=9 pytest tests/concurrency")
    first = report.mismatches[0]
    assert f"seed 9 client {first.client} ({first.transport}) request {first.request_id}" in text
    assert "expected" in text and "replay: EDGESERVE_CONC_SEEDS=9" in text
    if fault == "swap":  # the wrong rows are traced back to their owner
        assert "decodes to client" in text
    if fault == "rows":
        assert "came back in another order" in text
    if fault == "other_sequence":
        assert any("client" in m.got or "sequence" in m.got for m in report.mismatches if m.kind == "corrid")


def _versioned_op(model: AffineModel, x: Array, version: str = "") -> Op:
    return Op(
        0,
        0,
        "http",
        0.0,
        False,
        [Call(model.name, {"X": x}, ["Y"], "r", version=version)],
        [Expect(model, x=x)],
    )


@SETTINGS
@given(low=st.integers(1, 6), extra=st.integers(0, 3), answered=st.integers(1, 12))
def test_versions_outside_the_window_are_flagged(low: int, extra: int, answered: int) -> None:
    model = RELOADABLE[0]
    x = np.array([identity_row(1, 2, 0, 3)], np.float32)
    y = model.with_version(answered).expected(x)
    high = low + extra
    found = Checker(4).check(
        _versioned_op(model, x), [Answer({"Y": y}, model_version=str(answered))], (low, high)
    )
    assert (found == []) == (low <= answered <= high)
    label = Checker(4).check(
        _versioned_op(model, x), [Answer({"Y": y}, model_version=str(answered + 1))], (answered, answered)
    )
    assert [m.kind for m in label] == ["version_label"]


def test_a_named_version_may_be_refused_only_once_replaced() -> None:
    model = RELOADABLE[0]
    x = np.array([identity_row(1, 2, 0, 3)], np.float32)
    refusal = Answer(error="[503] Request for unknown model: 'reload_ort' version 2 is not at ready state")
    op = _versioned_op(model, x, "2")
    assert Checker(1).check(op, [refusal], (2, 3), named=2) == []  # version 3 was loading: fine
    assert [m.kind for m in Checker(1).check(op, [refusal], (2, 2), named=2)] == ["error"]
    other = Answer({"Y": model.with_version(3).expected(x)})
    assert [m.kind for m in Checker(1).check(op, [other], (2, 3), named=2)] == ["version"]


def test_python_rows_are_checked() -> None:
    seq = next(s for s in SEQUENCES if s.backend == "python")
    sid = seq.sequence_id(1, 1, 1, 1)
    outputs: dict[str, Array] = {
        "OUTPUT": np.full((1, 1), 5.0, np.float32),
        "ROWS": np.full((1, 1), 3, np.int32),
    }
    for flag in seq.flags:
        outputs[f"ECHO_{flag.kind}"] = np.full(
            (1, 1), float(bool(flag.value(True))) if flag.dtype == "bool" else flag.value(True), np.float32
        )
    outputs["ECHO_CORRID"] = np.full((1, 1), seq.corrid_value(sid), dtype=CORRID_TYPES[str(seq.corrid)][1])
    outputs["REQ_FLAGS"] = np.full((1, 1), 3, np.int32)
    outputs["REQ_CORRID"] = np.full((1, 1), str(sid).encode(), dtype=np.object_)
    op = Op(
        2,
        0,
        "zmq",
        0.0,
        False,
        [Call(seq.name, {}, seq.outputs, "r")],
        [Expect(seq, step=0, length=1, total=5.0, sequence_id=sid)],
    )
    assert [m.kind for m in Checker(1).check(op, [Answer(outputs)])] == ["rows"]


def test_flags_print_their_config() -> None:
    assert Flag("END", "int32", 5, 9).pbtxt() == (
        '{ name: "END", control [ { kind: CONTROL_SEQUENCE_END, int32_false_true: [ 5, 9 ] } ] }'
    )
    assert "bool_false_true: [ false, true ]" in Flag("START", "bool").pbtxt()


def test_model_files_are_written(tmp_path: Path) -> None:
    for model in STATELESS:
        model.write(tmp_path)
    for seq in SEQUENCES:
        seq.write(tmp_path)
    assert (tmp_path / "ens_py" / "config.pbtxt").read_text().count("model_name") == 3
    assert (tmp_path / "pyseq_direct" / "1" / "model.py").exists()
    assert "data_type: TYPE_STRING" in (tmp_path / "seq_str_direct" / "config.pbtxt").read_text()
