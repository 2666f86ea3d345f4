# shellcheck shell=bash
# Sourced by run.sh and test.sh: create .venv and install edgeserve with the given extra, idempotently.
# Usage: source scripts/setup-env.sh; setup_env cpu|test

step() { printf '\n==> %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo "$@"
  else return 1
  fi
}

apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 && return 0
  step "apt-get update (for $*)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
}

pick_python() {
  for candidate in "${PYTHON:-}" python3 python; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "edgeserve needs Python >= 3.10 (set PYTHON=/path/to/python3)" >&2
  return 1
}

make_venv() {
  local python; python=$(pick_python) || return 1
  if [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; then
    return 0
  fi
  step "creating .venv with $($python --version 2>&1)"
  rm -rf .venv
  if ! "$python" -m venv .venv 2>/dev/null; then
    # Debian/Ubuntu ship venv/ensurepip separately.
    local version; version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    step "installing python${version}-venv"
    apt_install "python${version}-venv" || apt_install python3-venv || {
      echo "cannot create a virtual environment: install python3-venv (needs root or sudo)" >&2; return 1; }
    rm -rf .venv
    "$python" -m venv .venv
  fi
  .venv/bin/python -m pip install -q --upgrade pip
}

# Reinstall only when pyproject.toml changed since the last successful install of this extra.
install_edgeserve() {
  local extra=$1
  local stamp=".venv/.edgeserve-${extra}.stamp"
  local digest; digest=$(.venv/bin/python -c 'import hashlib,sys; print(hashlib.sha256(open("pyproject.toml","rb").read()).hexdigest())')
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && .venv/bin/python -c 'import edgeserve' 2>/dev/null; then
    step "edgeserve[$extra] already installed in .venv"
    return 0
  fi
  step "pip install -e '.[$extra]' (first run downloads the runtimes; a few minutes)"
  .venv/bin/python -m pip install --progress-bar off -e ".[$extra]"
  echo "$digest" > "$stamp"
}

fetch_samples() {
  step "sample models (models/): tiny MLP + PP-OCR det/cls/rec"
  .venv/bin/edgeserve samples --model-repository models
}

setup_env() {
  make_venv && install_edgeserve "$1" && fetch_samples
}
