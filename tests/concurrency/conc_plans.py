"""Seeded plans of the concurrency suite's clients: a seed fixes every client's ops (which models,
batch rows, sequence lengths and values, think times, pipelining, HTTP binary or JSON tensors, short
deadlines, repeats for the cache, versions named); each call comes with what it must get back."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from conc_models import AffineModel, Array
from conc_seq_models import SeqModel
from conc_transports import DEADLINE_WIRES, Call
from conc_wires import CONCURRENT, ORDERED, TRANSPORTS

HOT_ROWS = 8  # rows every client may send (cross-client cache hits)


@dataclass(frozen=True)
class Mix:
    """What the clients send, and how."""

    stateless: tuple[AffineModel, ...] = ()
    sequences: tuple[SeqModel, ...] = ()
    p_sequence: float = 0.5
    max_rows: int = 4
    max_burst: int = 4
    max_steps: int = 8
    max_think_ms: float = 3.0
    p_repeat: float = 0.25  # resend an earlier X (cache hits, where the cache is on)
    p_reuse_id: float = 0.2  # start the last finished sequence's ID again (its state must restart)
    p_pipelined: float = 0.6  # where the wire allows: all calls of an op in flight at once
    p_json: float = 0.3  # HTTP: JSON tensors instead of binary ones
    p_versioned: float = 0.0  # reloadable models: name the version that was serving when the op began
    p_deadline: float = 0.0  # stateless calls on DEADLINE_WIRES: a 1-10 ms client deadline
    transports: tuple[str, ...] = TRANSPORTS


@dataclass
class Expect:
    """What a call must get back."""

    model: AffineModel | SeqModel
    x: Array | None = None  # stateless: the rows sent
    step: int = 0  # sequence: this call's step, of `length`
    length: int = 0
    total: float = 0.0  # sequence: the running sum after this step
    sequence_id: int | str = 0
    may_give_up: bool = False  # a short client deadline: DEADLINE_EXCEEDED is an answer too


@dataclass
class Op:
    client: int
    number: int
    transport: str
    think_s: float
    pipelined: bool
    calls: list[Call]
    expects: list[Expect]
    versioned: bool = False


# -- plans ---------------------------------------------------------------------------------------------
def identity_row(client: int, counter: int, row: int, salt: int) -> list[float]:
    # Every column stays below 2**20: X * 3 + c, and the ensemble's ((X + 10) * 3 + c) * 2, stay exact.
    return [float(client % 4096), float(counter % 2**20), float(row), float(salt)]


def hot_rows(seed: int) -> Array:
    rng = np.random.default_rng([seed, 999_999])
    return np.array([identity_row(4095, h, 0, int(rng.integers(2**20))) for h in range(HOT_ROWS)], np.float32)


def client_ops(seed: int, run: int, client: int, mix: Mix) -> Iterator[Op]:
    """Client `client`'s endless plan (take as many ops as the round wants)."""
    rng = np.random.default_rng([seed, run, client])
    transport = mix.transports[client % len(mix.transports)]
    sent: list[Array] = []
    hot = hot_rows(seed)
    counter = itertools.count()
    last_ids: dict[str, int | str] = {}
    numbers: dict[str, int] = collections.Counter()
    for number in itertools.count():
        think = float(rng.uniform(0, mix.max_think_ms)) / 1000
        pipelined = bool(rng.random() < mix.p_pipelined)
        binary = bool(rng.random() >= mix.p_json)
        use_sequence = mix.sequences and (not mix.stateless or rng.random() < mix.p_sequence)
        calls: list[Call] = []
        expects: list[Expect] = []
        versioned = False
        if use_sequence:
            seq = mix.sequences[int(rng.integers(len(mix.sequences)))]
            if seq.name in last_ids and rng.random() < mix.p_reuse_id:
                sequence_id = last_ids[seq.name]
            else:
                numbers[seq.name] += 1
                sequence_id = seq.sequence_id(
                    seed, run, client, numbers[seq.name], not transport.startswith("grpc")
                )
            last_ids[seq.name] = sequence_id
            length = int(rng.integers(1, mix.max_steps + 1))
            total = 0.0
            for step in range(length):
                value = float(rng.integers(1, 1000))
                total += value
                calls.append(
                    Call(
                        seq.name,
                        {"INPUT": np.full(seq.input_shape(), value, np.float32)},
                        seq.outputs,
                        f"c{client}-o{number}-s{step}",
                        sequence_id=sequence_id,
                        start=step == 0,
                        end=step == length - 1,
                        binary=binary,
                    )
                )
                expects.append(Expect(seq, step=step, length=length, total=total, sequence_id=sequence_id))
        else:
            reloadable = [m for m in mix.stateless if m.reloadable]
            versioned = bool(reloadable) and bool(rng.random() < mix.p_versioned)
            models = reloadable if versioned else mix.stateless
            for i in range(int(rng.integers(1, mix.max_burst + 1))):
                model = models[int(rng.integers(len(models)))]
                pick = rng.random()
                if pick < mix.p_repeat / 2 and sent:
                    x = sent[int(rng.integers(len(sent)))]
                elif pick < mix.p_repeat:
                    x = hot[int(rng.integers(HOT_ROWS))][None, :]
                else:
                    rows = int(rng.integers(1, mix.max_rows + 1))
                    n = next(counter)
                    x = np.array(
                        [identity_row(client, n, r, int(rng.integers(2**20))) for r in range(rows)],
                        np.float32,
                    )
                    sent.append(x)
                    del sent[:-32]
                short = transport in DEADLINE_WIRES and bool(rng.random() < mix.p_deadline)
                timeout = float(rng.uniform(0.001, 0.01)) if short else None
                rid = f"c{client}-o{number}-{i}"
                calls.append(Call(model.name, {"X": x}, model.outputs, rid, binary=binary, timeout_s=timeout))
                expects.append(Expect(model, x=x, may_give_up=short))
        pipelined = pipelined and transport in (ORDERED if use_sequence else CONCURRENT)
        yield Op(client, number, transport, think, pipelined, calls, expects, versioned)
