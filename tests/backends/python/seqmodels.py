"""A Triton-style Python sequence model for the tests: a running sum per CORRID, with every control
input echoed back, written as a Triton user writes it (one request per sequence slot, scalars read
from row 0 and broadcast to the request's shape). A negative INPUT gets an error response."""

from __future__ import annotations

SEQ_SUM = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            def get(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            value = get("INPUT")
            if value[0][0] < 0:  # this request's own error; the others of the batch go on
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
                continue
            start, end, ready, corrid = get("START"), get("END"), get("READY"), get("CORRID")
            key = int(corrid[0][0])
            total = 0.0
            if ready[0][0]:
                if start[0][0]:
                    self.sums[key] = 0.0
                self.sums[key] = self.sums.get(key, 0.0) + float(value[0][0])
                total = self.sums[key]
            shape = value.shape
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.full(shape, total, np.float32)),
                pb_utils.Tensor("START_OUT", np.full(shape, start[0][0], np.float32)),
                pb_utils.Tensor("END_OUT", np.full(shape, end[0][0], np.int32)),
                pb_utils.Tensor("READY_OUT", np.full(shape, ready[0][0], np.float32)),
                pb_utils.Tensor("CORRID_OUT", np.full(shape, corrid[0][0], np.uint64)),
                pb_utils.Tensor("ID_OUT", np.full(shape, request.correlation_id(), np.uint64)),
                pb_utils.Tensor("FLAGS_OUT", np.full(shape, request.flags(), np.uint32)),
            ]))
        return responses
"""

SEQ_SUM_CONFIG = """
name: "seq_sum"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "START_OUT" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "END_OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "READY_OUT" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "CORRID_OUT" data_type: TYPE_UINT64 dims: [ 1 ] },
  { name: "ID_OUT" data_type: TYPE_UINT64 dims: [ 1 ] },
  { name: "FLAGS_OUT" data_type: TYPE_UINT32 dims: [ 1 ] }
]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

# The same model under the Oldest strategy (rows compacted, no empty slots).
SEQ_SUM_OLDEST_CONFIG = SEQ_SUM_CONFIG.replace('name: "seq_sum"', 'name: "seq_sum_oldest"').replace(
    "  control_input [",
    "  oldest { max_candidate_sequences: 8 preferred_batch_size: [ 4 ] "
    "max_queue_delay_microseconds: 100000 }\n  control_input [",
)
