# shellcheck shell=bash
# Sourced by run.sh and test.sh: create a venv and install edgeserve with the given extra, idempotently.
# Usage: source scripts/setup-env.sh; setup_env cpu|test
# The venv is .venv, made from the first Python >= 3.10 of $PYTHON, python3, python. With
# EDGESERVE_PYTHON=/path/to/python (e.g. Debian's /usr/bin/python3, a pyenv 3.10) it is
# .venvs/<that interpreter's version> instead, so other Pythons are tested without touching .venv.
# Callers use $VENV (set by setup_env) for the venv's folder.

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

# The interpreter's full sys.version (release, build date, compiler): a venv made from another build of
# the same release is made again rather than reused.
python_build() { "$1" -c 'import sys; print(sys.version)' 2>/dev/null; }

choose_venv() {
  if [ -z "${EDGESERVE_PYTHON:-}" ]; then
    PYTHON_FOR_VENV=$(pick_python) || return 1
    VENV=.venv
    return 0
  fi
  if ! "$EDGESERVE_PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
    echo "EDGESERVE_PYTHON=$EDGESERVE_PYTHON is not a Python >= 3.10" >&2
    return 1
  fi
  PYTHON_FOR_VENV=$EDGESERVE_PYTHON
  VENV=.venvs/$("$EDGESERVE_PYTHON" -c 'import platform; print(platform.python_version())')
  # Chosen: what runs from here (pytest, edgeserve) must not inherit it, as the Mender Update Module
  # reads the same variable for its own interpreter (ota/mender/edgeserve-bundle).
  unset EDGESERVE_PYTHON
}

make_venv() {
  local python=$PYTHON_FOR_VENV
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -m pip --version >/dev/null 2>&1 &&
     { [ "$VENV" = .venv ] || [ "$(python_build "$VENV/bin/python")" = "$(python_build "$python")" ]; }; then
    return 0
  fi
  step "creating $VENV with $python ($($python --version 2>&1))"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  if ! "$python" -m venv "$VENV" 2>/dev/null; then
    # Debian/Ubuntu ship venv/ensurepip separately.
    local version; version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    step "installing python${version}-venv"
    apt_install "python${version}-venv" || apt_install python3-venv || {
      echo "cannot create a virtual environment: install python3-venv (needs root or sudo)" >&2; return 1; }
    rm -rf "$VENV"
    "$python" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
}

# Reinstall only when pyproject.toml changed since the last successful install of this extra.
install_edgeserve() {
  local extra=$1
  local stamp="$VENV/.edgeserve-${extra}.stamp"
  local digest; digest=$("$VENV/bin/python" -c 'import hashlib,sys; print(hashlib.sha256(open("pyproject.toml","rb").read()).hexdigest())')
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && "$VENV/bin/python" -c 'import edgeserve' 2>/dev/null; then
    step "edgeserve[$extra] already installed in $VENV"
    return 0
  fi
  step "pip install -e '.[$extra]' (first run downloads the runtimes; a few minutes)"
  "$VENV/bin/python" -m pip install --progress-bar off -e ".[$extra]"
  echo "$digest" > "$stamp"
}

fetch_samples() {
  step "sample models (models/): tiny MLP + PP-OCR det/cls/rec"
  "$VENV/bin/edgeserve" samples --model-repository models
}

setup_env() {
  choose_venv && make_venv && install_edgeserve "$1" && fetch_samples
}
