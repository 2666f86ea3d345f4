"""model.py sources for the in-process decoupled stand-in (decoupled_stub.py), and their configs.

Each model answers on a thread of its own after `infer_decoupled` returned (as Triton's decoupled
examples do) and, when done, writes `<model dir>/done-<request id>` = "cancelled=<bool> sent=<n>",
so a test learns what the model saw without reaching into the server."""

from __future__ import annotations

COMMON = '''
import threading
import numpy as np


class Model:
    def __init__(self, config, model_dir):
        self.model_dir = model_dir

    def infer(self, inputs, outputs=None):
        raise RuntimeError("a decoupled model runs through infer_decoupled")

    def infer_decoupled(self, batch, infos, sinks):
        for inputs, info, sink in zip(batch, infos, sinks):
            threading.Thread(target=self.run_one, args=(inputs, info, sink), daemon=True).start()

    def done(self, info, sink, sent):
        path = self.model_dir / f"done-{info.request_id}"
        path.with_suffix(".tmp").write_text(f"cancelled={sink.cancelled} sent={sent}")
        path.with_suffix(".tmp").replace(path)

    def close(self):
        pass
'''

# Triton's "repeat" pattern: one response per element of IN (OUT, IDX), then the final flag alone.
REPEAT = COMMON + '''
    def run_one(self, inputs, info, sink):
        sent = 0
        for index, value in enumerate(np.asarray(inputs["IN"]).reshape(-1)):
            if sink.cancelled:
                break
            sink.send({"OUT": np.array([value], np.int32), "IDX": np.array([index], np.uint32)})
            sent += 1
        sink.send(None, final=True)
        self.done(info, sink, sent)
'''

# One response, then never the final flag until its request is cancelled (a hostile model).
NEVER_FINAL = COMMON + '''
    def run_one(self, inputs, info, sink):
        sink.send({"OUT": np.array([1], np.int32), "IDX": np.array([0], np.uint32)})
        while not sink.cancelled:
            threading.Event().wait(0.01)
        self.done(info, sink, 1)
        sink.send(None, final=True)
'''

# IN[0] responses of IN[1] int32 values each, as fast as it can, until cancelled (a flood).
FLOOD = COMMON + '''
    def run_one(self, inputs, info, sink):
        count, width = (int(v) for v in np.asarray(inputs["IN"]).reshape(-1)[:2])
        payload = np.zeros(width, np.int32)
        sent = 0
        for index in range(count):
            if sink.cancelled:
                break
            sink.send({"OUT": payload, "IDX": np.array([index], np.uint32)})
            sent += 1
        self.done(info, sink, sent)
        if not sink.cancelled:
            sink.send(None, final=True)
'''

DECOUPLED_CONFIG = """max_batch_size: 0
model_transaction_policy { decoupled: true }
input [{ name: "IN", data_type: TYPE_INT32, dims: [-1] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [-1] },
        { name: "IDX", data_type: TYPE_UINT32, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


def bounded(capacity: int, stall_s: float) -> str:
    """Config lines: the response stream's bound and how long a stuck reader is waited for."""
    return (
        f'parameters {{ key: "stream_buffer_responses" value {{ string_value: "{capacity}" }} }}\n'
        f'parameters {{ key: "stream_stall_timeout_s" value {{ string_value: "{stall_s}" }} }}\n'
    )
