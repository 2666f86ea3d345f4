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

# Same inputs and outputs as add_sub (pymodels.ADD_SUB_CONFIG): the BLS models below call add_sub.
BLS_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [
  {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] }},
  {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ -1, 4 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] }},
  {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1, 4 ] }}
]
instance_group [{{ kind: KIND_CPU, count: 1 }}]
"""

# BLS, sync: the request's parameter "target" names the model to call (default add_sub) and "cast"
# sends INPUT0 as int32 (a wrong dtype). An error response of the call is passed on as
# "<code>: <message>" (the client sees Triton's code).
BLS_SYNC = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            if params.get("cast"):
                in0 = pb_utils.Tensor("INPUT0", in0.as_numpy().astype(np.int32))
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            call = pb_utils.InferenceRequest(
                model_name=params.get("target", "add_sub"), inputs=[in0, in1],
                requested_output_names=["OUTPUT0", "OUTPUT1"])
            result = call.exec()
            if result.has_error():
                error = result.error()
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"{error.code()}: {error.message()}")))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(result, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(result, "OUTPUT1")]))
        return responses
"""

# BLS, async: two calls in flight at once (asyncio.gather), OUTPUT0 from the first, OUTPUT1 the second.
BLS_ASYNC = """
import asyncio
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [pb_utils.get_input_tensor_by_name(request, n) for n in ("INPUT0", "INPUT1")]
            calls = [pb_utils.InferenceRequest(model_name="add_sub", inputs=inputs,
                                               requested_output_names=[name]).async_exec()
                     for name in ("OUTPUT0", "OUTPUT1")]
            first, second = await asyncio.gather(*calls)
            for result in (first, second):
                if result.has_error():
                    raise pb_utils.TritonModelException(result.error().message())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(first, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(second, "OUTPUT1")]))
        return responses
"""

# BLS into a decoupled model (repeat): sums the OUT of every response of one call.
BLS_DECOUPLED_CONFIG = """
name: "bls_decoupled"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [
  { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""
BLS_DECOUPLED = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily(name="bls_calls", description="BLS calls made",
                                       kind=pb_utils.MetricFamily.COUNTER)
        self.calls = family.Metric(labels={"target": "repeat"})

    def execute(self, requests):
        request = requests[0]
        call = pb_utils.InferenceRequest(model_name="repeat", requested_output_names=["OUT"],
                                         inputs=[pb_utils.get_input_tensor_by_name(request, "IN")])
        total, count = 0, 0
        for response in call.exec(decoupled=True):
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            if response.output_tensors():
                total += int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
                count += 1
        self.calls.increment(1)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SUM", np.array([total], np.int32)),
                                            pb_utils.Tensor("COUNT", np.array([count], np.int32))])]
"""
