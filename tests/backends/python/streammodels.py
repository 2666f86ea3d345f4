"""Python models for the decoupled / BLS / async / metrics tests: the patterns of Triton's python_backend
examples (decoupled repeat and square, bls, bls_decoupled, custom_metrics), written for these tests."""

from __future__ import annotations

DECOUPLED_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [
  {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "IDX" data_type: TYPE_INT32 dims: [ 1 ] }}
]
instance_group [{{ kind: KIND_CPU, count: 1 }}]
"""

# One response per element of IN (OUT = the element, IDX = its position), from a thread the model
# starts, after execute() returned; then the final flag alone.
REPEAT = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            thread = threading.Thread(target=self.respond, args=(request.get_response_sender(), values))
            thread.start()
            self.threads.append(thread)
        return None

    def respond(self, sender, values):
        for index, value in enumerate(values):
            out = pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))
            idx = pb_utils.Tensor("IDX", np.array([index], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
"""

# async execute: IN[0] responses, each the square of IN[0]; every request first waits until IN[1]
# requests are in flight at once (so it ends only when executes really run concurrently).
SQUARE_ASYNC = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def initialize(self, args):
        self.started = 0
        self.all_in = asyncio.Event()

    async def execute(self, requests):
        for request in requests:
            count, together = (int(v) for v in pb_utils.get_input_tensor_by_name(request, "IN").as_numpy())
            self.started += 1
            if self.started >= together:
                self.all_in.set()
            await self.all_in.wait()
            sender = request.get_response_sender()
            for index in range(count):
                out = pb_utils.Tensor("OUT", np.array([count * count], dtype=np.int32))
                idx = pb_utils.Tensor("IDX", np.array([index], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse([out, idx]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# Sends its one response with the final flag, then another: the second must reach nobody.
AFTER_FINAL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            one = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32)),
                                              pb_utils.Tensor("IDX", np.array([0], np.int32))])
            sender.send(one, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            try:
                sender.send(one)
            except pb_utils.TritonModelException as exc:
                pb_utils.Logger.log_info(f"second send refused: {exc}")
        return None
"""

# Never sends the final flag on its own: it waits until the request is cancelled, then ends it.
UNTIL_CANCELLED = """
import threading
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.wait, args=(request,)).start()
        return None

    def wait(self, request):
        sender = request.get_response_sender()
        while not request.is_cancelled():
            time.sleep(0.01)  # polling, as a model checks between steps
        pb_utils.Logger.log_info("saw the cancellation")
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# Up to IN[0] responses of one int32 each, until cancelled (a flood for a slow reader).
FLOOD = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        total = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
        sender = request.get_response_sender()
        one = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], np.int32)),
                                          pb_utils.Tensor("IDX", np.array([0], np.int32))])
        for index in range(total):
            sender.send(one)
            if sender.is_cancelled():
                break
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
