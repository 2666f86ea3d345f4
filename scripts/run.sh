#!/usr/bin/env bash
# Set up edgeserve in .venv (idempotent; EDGESERVE_PYTHON: see setup-env.sh) and run the appliance on the
# sample model repository models/.
# HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:8001; extra arguments go to `edgeserve run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-env.sh
setup_env cpu
step "edgeserve run --model-repository models $*  (Ctrl-C to stop)"
exec "$VENV/bin/edgeserve" run --model-repository models "$@"
