"""The concurrency suite's checker: each answer against the client-side reference of its request
(conc_models.py, conc_seq_models.py); a wrong one becomes a `Mismatch` that names the seed, client,
wire, request id and model, what was expected and what came, and whose answer it was where the wrong
values decode to another request."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from conc_models import VERSION_STEP, AffineModel, Array
from conc_plans import Expect, Op
from conc_seq_models import ID_BASE, NARROW_UINT64_BASE, SeqModel
from conc_transports import Answer, Call

from edgeserve.scheduling.queue import QUEUE_FULL_MESSAGE

if TYPE_CHECKING:
    from workload import Report


@dataclass(frozen=True)
class Mismatch:
    kind: str
    seed: int
    client: int
    transport: str
    request_id: str
    where: str
    expected: str
    got: str

    def __str__(self) -> str:
        return (
            f"[{self.kind}] seed {self.seed} client {self.client} ({self.transport}) request "
            f"{self.request_id} {self.where}: expected {self.expected}; got {self.got}"
        )


# -- checking ------------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    array = np.asarray(value)
    return np.array2string(array, separator=",", threshold=16) if array.size > 1 else repr(array.item())


def whose(model: AffineModel, y: Array) -> str:
    """Who a wrong stateless answer belongs to, decoded from its identity rows."""
    x = np.rint(model.decode(np.asarray(y, np.float64)))
    if x.ndim != 2 or x.shape[1] != 4:
        return ""
    rows = [f"client {int(r[0])} request counter {int(r[1])} row {int(r[2])}" for r in x[:2]]
    return "; decodes to " + " / ".join(rows) + (" ..." if len(x) > 2 else "")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _echoed_corrid(seq: SeqModel, outputs: dict[str, Array]) -> int | bytes | None:
    if not seq.corrid:
        return None
    value = outputs["ECHO_CORRID"].reshape(-1)[0]
    if seq.corrid == "string":
        return value.encode() if isinstance(value, str) else bytes(value)
    return int(value)


def _sequence_owner(seq: SeqModel, corrid: int | bytes | None) -> str:
    """Whose sequence an echoed CORRID is (the ID layout of SeqModel.sequence_id)."""
    if corrid is None or isinstance(corrid, bytes):
        return ""
    offset = corrid - ID_BASE[seq.corrid]
    if offset < 0 and seq.corrid == "uint64":
        offset = corrid - NARROW_UINT64_BASE
    if offset < 0:
        return ""
    return f" (run {offset // 2**24}, client {offset % 2**24 // 2**17}, sequence number {offset % 2**17})"


def _retired(error: str, named: int | None, window: tuple[int, int] | None) -> bool:
    """Whether `error` is the refusal of a named version that a newer one replaced meanwhile."""
    if named is None or window is None or named >= window[1]:
        return False
    return f"version {named}" in error and ("not at ready state" in error or "not available" in error)


class Checker:
    """Checks answers against the references; `window` gives the versions a versioned model may
    answer with (reload rounds)."""

    def __init__(self, seed: int, report: Report | None = None) -> None:
        self.seed = seed
        self.report = report

    def _note(self, what: str) -> None:
        """Count an accepted non-answer (a refusal or a deadline the client asked for)."""
        if self.report is not None:
            with self.report.lock:
                self.report.notes[what] += 1

    def check(
        self,
        op: Op,
        answers: Sequence[Answer],
        window: tuple[int, int] | None = None,
        named: int | None = None,
    ) -> list[Mismatch]:
        found: list[Mismatch] = []
        for call, expect, answer in zip(op.calls, op.expects, answers, strict=True):

            def bad(kind: str, expected: Any, got: Any, call: Call = call) -> None:
                found.append(
                    Mismatch(
                        kind,
                        self.seed,
                        op.client,
                        op.transport,
                        call.request_id,
                        call.describe(),
                        str(expected),
                        str(got),
                    )
                )

            if answer.error is not None:
                if not answer.lost and _retired(answer.error, named, window):
                    self._note("refused: named version replaced")  # a clear refusal is right
                    continue
                if (
                    QUEUE_FULL_MESSAGE in answer.error
                    and not answer.lost
                    and not isinstance(expect.model, SeqModel)
                ):
                    self._note(
                        "refused: queue full"
                    )  # shed under overload: a clear refusal, no answer to check
                    continue
                if expect.may_give_up and "DEADLINE_EXCEEDED" in answer.error:
                    self._note("gave up: client deadline")  # as asked; its late answer must go nowhere
                    continue
                bad("lost" if answer.lost else "error", "an answer", answer.error)
                continue
            if answer.response_id is not None and answer.response_id != call.request_id:
                bad("request_id", f"response id {call.request_id!r}", repr(answer.response_id))
            outputs = answer.outputs or {}
            missing = [n for n in call.outputs if n not in outputs]
            if missing:
                bad("missing_output", call.outputs, sorted(outputs))
                continue
            if isinstance(expect.model, SeqModel):
                self._sequence(expect.model, expect, outputs, bad)
            elif expect.model.reloadable:
                span = window or (1, 1)
                self._versioned(expect.model, expect, answer, outputs["Y"], span, named, bad)
            else:
                self._stateless(expect.model, expect, outputs["Y"], bad)
            # The model's request_id() of each row: the call's ID where the wire carries it, else the
            # ZeroMQ client's own ID of the request (the one its reply was matched by).
            own_id = call.request_id if answer.response_id is not None else answer.wire_id
            if "RID" in outputs and own_id is not None:
                rids = {_text(v) for v in np.asarray(outputs["RID"]).reshape(-1)}
                if rids != {own_id}:
                    bad("request_id", f"request_id() {own_id!r} in the model", sorted(rids))
        return found

    @staticmethod
    def _stateless(model: AffineModel, expect: Expect, y: Array, bad: Callable[..., None]) -> None:
        assert expect.x is not None
        want = model.expected(expect.x)
        if y.shape != want.shape:
            bad("shape", list(want.shape), list(y.shape))
        elif not np.array_equal(y, want):
            mine = (
                " (rows of this request came back in another order)"
                if np.array_equal(np.sort(y, axis=0), np.sort(want, axis=0))
                else ""
            )
            bad("value", _fmt(want), _fmt(y) + mine + whose(model, y))

    @staticmethod
    def _versioned(
        model: AffineModel,
        expect: Expect,
        answer: Answer,
        y: Array,
        window: tuple[int, int],
        named: int | None,
        bad: Callable[..., None],
    ) -> None:
        assert expect.x is not None
        if y.shape != expect.x.shape:
            bad("shape", list(expect.x.shape), list(y.shape))
            return
        offset = np.asarray(y, np.float64) - model.k * np.asarray(expect.x, np.float64)
        version = int(np.rint(offset.reshape(-1)[0] / VERSION_STEP))
        if not np.array_equal(y, model.with_version(version).expected(expect.x)):
            bad("value", f"X * {model.k} + {VERSION_STEP:g} * version", _fmt(y) + whose(model, y))
            return
        low, high = (named, named) if named is not None else window
        if not low <= version <= high:
            what = f"version {named} (named)" if named is not None else f"a version in {low}..{high}"
            bad("version", what + " (loaded when the request was sent/answered)", f"version {version}")
        if answer.model_version not in (None, "", str(version)):
            bad(
                "version_label",
                f"model_version {version!r} (the answer's values)",
                repr(answer.model_version),
            )

    @staticmethod
    def _sequence(seq: SeqModel, expect: Expect, outputs: dict[str, Array], bad: Callable[..., None]) -> None:
        shape = seq.input_shape()
        flags = {"START": expect.step == 0, "END": expect.step == expect.length - 1, "READY": True}
        for name, array in outputs.items():
            if tuple(np.shape(array)) != shape:
                bad("shape", f"{name} {list(shape)}", list(np.shape(array)))
                return
        got_corrid = _echoed_corrid(seq, outputs)
        owner = _sequence_owner(seq, got_corrid)
        total = float(outputs["OUTPUT"].reshape(-1)[0])
        if total != expect.total:
            bad(
                "value",
                f"running sum {expect.total:g} after step {expect.step + 1} of {expect.length}",
                f"{total:g}" + (f"; CORRID {got_corrid!r}{owner}" if seq.corrid else ""),
            )
        for flag in seq.flags:
            got = float(outputs[f"ECHO_{flag.kind}"].reshape(-1)[0])
            want = flag.value(flags[flag.kind])
            if flag.dtype == "bool":
                want = float(bool(want))
            if got != want:
                bad(
                    "control",
                    f"{flag.kind} ({flag.dtype}) = {want:g} at step {expect.step + 1} of {expect.length}",
                    f"{got:g}",
                )
        want_corrid = seq.corrid_value(expect.sequence_id)
        if seq.corrid and got_corrid != want_corrid:
            bad("corrid", f"CORRID ({seq.corrid}) {want_corrid!r}", f"{got_corrid!r}{owner}")
        if "REQ_FLAGS" in outputs:
            want_flags = (1 if expect.step == 0 else 0) | (2 if expect.step == expect.length - 1 else 0)
            got_flags = int(outputs["REQ_FLAGS"].reshape(-1)[0])
            if got_flags != want_flags:
                bad("control", f"request flags() {want_flags} (1 = START, 2 = END)", got_flags)
            got_id = _text(outputs["REQ_CORRID"].reshape(-1)[0])
            if got_id != str(expect.sequence_id):
                bad("corrid", f"request correlation_id() {str(expect.sequence_id)!r}", repr(got_id))
        if "ROWS" in outputs and int(outputs["ROWS"].reshape(-1)[0]) != 1:
            bad(
                "rows",
                "one row per Python request (Triton gives execute() one request per sequence step)",
                f"{int(outputs['ROWS'].reshape(-1)[0])} rows in the request",
            )
