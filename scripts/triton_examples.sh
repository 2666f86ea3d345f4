#!/usr/bin/env bash
# Run Triton's python_backend examples, unchanged, with their own client scripts, against
# `edgeserve serve --http-port 8000 --grpc-port 8001` (metrics on Triton's 8002), one model repository
# per example laid out as its README says. A maintainer's tool, not part of the test suite (CI has no
# copy of Triton's repository); tests/backends/python/ keeps our own copies of the patterns.
#
#   git clone https://github.com/triton-inference-server/python_backend /tmp/pb
#   scripts/triton_examples.sh /tmp/pb/examples [log-file [example ...]]   (default: all of them)
#
# The `pytorch` model that the bls example calls is a Python model importing torch; it is replaced by
# an ONNX model of the same name and I/O (INPUT0, INPUT1 [4] FP32 -> OUTPUT0 = sum, OUTPUT1 = difference),
# built here with onnx.helper. Exit status: the number of examples that failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EX="$(cd "${1:?usage: $0 <python_backend>/examples [log-file [example ...]]}" && pwd)"
LOG="${2:-/dev/null}"
shift $(($# < 2 ? $# : 2))
PY="$ROOT/.venv/bin/python"
ES="$ROOT/.venv/bin/edgeserve"
WORK="$(mktemp -d /tmp/triton-examples.XXXXXX)"
SERVER_PID=""
: >"$LOG"

cleanup() {
    stop_server
    rm -rf "$WORK"
}
trap cleanup EXIT

say() { echo "$*" | tee -a "$LOG"; }

# ports_free: 8000/8001/8002 (the examples' clients dial them) free, waiting up to 5 minutes for them
ports_free() {
    local deadline=$((SECONDS + 300)) port
    for port in 8000 8001 8002; do
        while ss -Hltn "sport = :$port" | grep -q .; do
            if ((SECONDS > deadline)); then
                say "port $port is in use: the examples' clients dial 8000/8001/8002; stop what listens there"
                return 1
            fi
            sleep 1
        done
    done
}

stop_server() {
    if [[ -n "$SERVER_PID" ]]; then
        kill -TERM "$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
        SERVER_PID=""
    fi
}

# start_server <repository>: edgeserve serve on the examples' ports, waits until every model is ready
start_server() {
    local repo="$1" deadline
    ports_free || return 1
    "$ES" serve --model-repository "$repo" --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
        --zmq-endpoint "ipc://$WORK/zmq" --state-dir "$WORK/state" >"$WORK/server.log" 2>&1 &
    SERVER_PID=$!
    deadline=$((SECONDS + 180))  # generous: a slow shared box loads Python workers slowly
    until curl -sf -o /dev/null localhost:8000/v2/health/ready; do
        # "ready=False" once loading ended: a model failed to load, it will not become ready
        if ! kill -0 "$SERVER_PID" 2>/dev/null || ((SECONDS > deadline)) ||
            grep -q "server ready=False" "$WORK/server.log"; then
            say "  server did not become ready; its log:"
            sed 's/^/    | /' "$WORK/server.log" | tail -40 | tee -a "$LOG"
            stop_server
            return 1
        fi
        sleep 0.2
    done
}

# model <repo> <name> <model.py> [config.pbtxt]: <repo>/<name>/1/model.py (+ config.pbtxt), copied
model() {
    mkdir -p "$1/$2/1"
    cp "$3" "$1/$2/1/model.py"
    if [[ $# -ge 4 ]]; then cp "$4" "$1/$2/config.pbtxt"; fi
}

# onnx_add_sub <repo>: the `pytorch` model as ONNX (same name and I/O as examples/pytorch)
onnx_add_sub() {
    mkdir -p "$1/pytorch/1"
    cat >"$1/pytorch/config.pbtxt" <<'EOF'
name: "pytorch"
platform: "onnxruntime_onnx"
input [
  { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "INPUT1", data_type: TYPE_FP32, dims: [ 4 ] }
]
output [
  { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "OUTPUT1", data_type: TYPE_FP32, dims: [ 4 ] }
]
instance_group [{ kind: KIND_CPU }]
EOF
    "$PY" - "$1/pytorch/1/model.onnx" <<'EOF'
import sys
from onnx import TensorProto, helper, save

io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")]
graph = helper.make_graph(
    [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]), helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
    "pytorch", io[:2], io[2:],
)
save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), sys.argv[1])
EOF
}

# layout <example>: the model repository its README describes, in $WORK/<example>
layout() {
    local r="$WORK/$1"
    rm -rf "$r" && mkdir -p "$r"
    case "$1" in
        add_sub)
            model "$r" add_sub "$EX/add_sub/model.py" "$EX/add_sub/config.pbtxt" ;;
        auto_complete)  # no config.pbtxt: auto_complete_config fills it in
            model "$r" nobatch_auto_complete "$EX/auto_complete/nobatch_model.py"
            model "$r" batch_auto_complete "$EX/auto_complete/batch_model.py" ;;
        bls_sync | bls_async)
            model "$r" add_sub "$EX/add_sub/model.py" "$EX/add_sub/config.pbtxt"
            model "$r" "$1" "$EX/bls/${1#bls_}_model.py" "$EX/bls/${1#bls_}_config.pbtxt"
            onnx_add_sub "$r" ;;
        bls_decoupled_sync | bls_decoupled_async)
            model "$r" "$1" "$EX/bls_decoupled/${1#bls_decoupled_}_model.py" \
                "$EX/bls_decoupled/${1#bls_decoupled_}_config.pbtxt"
            model "$r" square_int32 "$EX/decoupled/square_model.py" "$EX/decoupled/square_config.pbtxt" ;;
        decoupled_repeat | decoupled_square)
            model "$r" repeat_int32 "$EX/decoupled/repeat_model.py" "$EX/decoupled/repeat_config.pbtxt"
            model "$r" square_int32 "$EX/decoupled/square_model.py" "$EX/decoupled/square_config.pbtxt" ;;
        custom_metrics)
            model "$r" custom_metrics "$EX/custom_metrics/model.py" "$EX/custom_metrics/config.pbtxt" ;;
    esac
}

client_of() {
    case "$1" in
        add_sub) echo add_sub/client.py ;;
        auto_complete) echo auto_complete/client.py ;;
        bls_sync) echo bls/sync_client.py ;;
        bls_async) echo bls/async_client.py ;;
        bls_decoupled_sync) echo bls_decoupled/sync_client.py ;;
        bls_decoupled_async) echo bls_decoupled/async_client.py ;;
        decoupled_repeat) echo decoupled/repeat_client.py ;;
        decoupled_square) echo decoupled/square_client.py ;;
        custom_metrics) echo custom_metrics/client.py ;;
    esac
}

EXAMPLES=(add_sub auto_complete bls_sync bls_async bls_decoupled_sync bls_decoupled_async
    decoupled_repeat decoupled_square custom_metrics)
if [[ $# -gt 0 ]]; then EXAMPLES=("$@"); fi
failed=0
summary=()
say "edgeserve $(git -C "$ROOT" rev-parse --short HEAD) against $EX"
for name in "${EXAMPLES[@]}"; do
    say ""
    say "===== $name: $(client_of "$name")"
    layout "$name"
    if ! start_server "$WORK/$name"; then
        failed=$((failed + 1)); summary+=("FAIL  $name (server not ready)"); continue
    fi
    (cd "$WORK" && timeout 120 "$PY" "$EX/$(client_of "$name")") >"$WORK/client.out" 2>&1
    rc=$?
    sed 's/^/  /' "$WORK/client.out" | tee -a "$LOG"
    stop_server
    # Triton's clients print PASS and exit 0 when they got what their README shows
    if [[ $rc -eq 0 ]] && grep -q '^PASS' "$WORK/client.out"; then
        summary+=("pass  $name")
    else
        failed=$((failed + 1)); summary+=("FAIL  $name (client exit $rc)")
        say "  server log (last 30 lines):"
        sed 's/^/    | /' "$WORK/server.log" | tail -30 | tee -a "$LOG"
    fi
    # what the server warned about, even when the client passed
    grep -E " (WARNING|ERROR) " "$WORK/server.log" | cut -c1-300 | sed 's/^/  server ! /' | tee -a "$LOG"
    if [[ "$name" == custom_metrics ]]; then  # the README's server-side line
        say "  server log: $(grep -m1 'Cumulative requests processing latency' "$WORK/server.log" || echo '(no latency line)')"
    fi
done
say ""
say "===== summary"
for line in "${summary[@]}"; do say "$line"; done
exit "$failed"
