#!/usr/bin/env bash
# Set up the test environment in .venv (idempotent) and run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/frontends/http -x`.
# EDGESERVE_PYTHON=/usr/bin/python3 (any interpreter >= 3.10) tests on that Python instead, in its own
# venv .venvs/<version> (scripts/setup-env.sh). In CI (CI=true) the whole suite is followed by
# tests/ota, tests/security and tests/fleet on Debian's /usr/bin/python3 when that is another build:
# it is the Python most appliances run (3.11.2 on Debian 12 / Raspberry Pi OS bookworm).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-env.sh
setup_env test

if command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; then
  step "mosquitto present (MQTT broker for the fleet tests)"
else
  step "installing mosquitto (MQTT broker for the fleet tests)"
  apt_install mosquitto || echo "warning: could not install mosquitto (needs root or sudo); broker tests will skip" >&2
fi

if command -v mender >/dev/null 2>&1 && command -v mender-artifact >/dev/null 2>&1; then
  step "mender and mender-artifact present (the Mender Update Module tests)"
else
  step "installing mender-client and mender-artifact (the Mender Update Module tests)"
  # The client's own service is not wanted here: the tests run it in standalone mode, in a private
  # mount namespace; no daemon is started (there is no systemd PID 1 in CI containers).
  apt_install mender-client mender-artifact ||
    echo "warning: could not install mender-client and mender-artifact (needs root or sudo, Debian 12 or" \
         "newer); the Mender tests will skip" >&2
fi

if command -v systemd-analyze >/dev/null 2>&1; then
  step "systemd-analyze present (checks systemd/edgeserve.service)"
else
  # Only the tools: the package does not make systemd PID 1 (that is systemd-sysv).
  step "installing systemd (systemd-analyze checks systemd/edgeserve.service)"
  apt_install --no-install-recommends systemd ||
    echo "warning: could not install systemd (needs root or sudo); the unit tests will skip" >&2
fi

# tests/video: an RTSP server on loopback (gst-rtsp-server, run by Debian's python3 with its gi
# bindings) and the H.264/H.265 payloaders and parsers it needs.
GST_PACKAGES="gstreamer1.0-rtsp gir1.2-gst-rtsp-server-1.0 gir1.2-gstreamer-1.0 python3-gi
  gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad"
if /usr/bin/python3 -c 'import gi; gi.require_version("GstRtspServer", "1.0"); from gi.repository import GstRtspServer' >/dev/null 2>&1; then
  step "gst-rtsp-server present (RTSP server for the video tests)"
else
  step "installing gst-rtsp-server (RTSP server for the video tests)"
  # shellcheck disable=SC2086
  apt_install --no-install-recommends $GST_PACKAGES ||
    echo "warning: could not install gst-rtsp-server (needs root or sudo); the RTSP tests will skip" >&2
fi

# `edgeserve watch gst:...` needs GStreamer's Python bindings in the venv: PyGObject has no wheels, so it
# is built here against Debian's GObject introspection (a compiler and the headers, a minute once).
if "$VENV/bin/python" -c 'import gi; gi.require_version("GstApp", "1.0"); from gi.repository import GstApp' >/dev/null 2>&1; then
  step "PyGObject present (the GStreamer source of edgeserve watch)"
else
  step "building PyGObject into $VENV (the GStreamer source of edgeserve watch)"
  { apt_install --no-install-recommends gcc pkg-config libgirepository1.0-dev libcairo2-dev \
      gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0 gstreamer1.0-plugins-base &&
    { "$VENV/bin/python" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
      apt_install --no-install-recommends python3-dev; } &&
    "$VENV/bin/python" -m pip install -q --progress-bar off "PyGObject<3.51"; } ||
    echo "warning: could not build PyGObject (needs root or sudo for its build packages); the GStreamer test will skip" >&2
fi

# Most tests wait on real servers, brokers and cameras: test files run in parallel worker processes
# (pytest-xdist), a file's tests in one worker so its module fixtures start once.
# EDGESERVE_TEST_WORKERS=0 runs everything in this process.
workers=${EDGESERVE_TEST_WORKERS:-auto}
parallel=()
[ "$workers" != "0" ] && parallel=(-n "$workers" --dist loadfile)
step "python -m pytest ${parallel[*]} $*  ($("$VENV/bin/python" --version 2>&1), $VENV)"
set +e
"$VENV/bin/python" -m pytest -ra "${parallel[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  rc=1
fi

# CI: the whole suite ran on the default Python; the OTA, fleet and security tests run again on Debian's
# system Python (a newer default would hide an API it lacks, as tarfile.data_filter once did).
SYSTEM_PYTHON=/usr/bin/python3
if [ "${CI:-}" = "true" ] && [ "$VENV" = .venv ] && [ "$#" -eq 0 ]; then
  if [ ! -x "$SYSTEM_PYTHON" ]; then
    echo "test.sh: warning: no $SYSTEM_PYTHON; the OTA, fleet and security tests ran on one Python only" >&2
  elif [ "$(python_build "$SYSTEM_PYTHON")" = "$(python_build "$VENV/bin/python")" ]; then
    step "$SYSTEM_PYTHON is the Python the suite just ran on; no second run"
  else
    step "again on $SYSTEM_PYTHON ($("$SYSTEM_PYTHON" --version 2>&1)): tests/ota tests/security tests/fleet"
    set +e
    EDGESERVE_PYTHON=$SYSTEM_PYTHON bash scripts/test.sh tests/ota tests/security tests/fleet
    system_rc=$?
    set -e
    if [ "$system_rc" -ne 0 ]; then
      echo "test.sh: the tests on $SYSTEM_PYTHON failed (exit $system_rc)" >&2
      [ "$rc" -eq 0 ] && rc=$system_rc
    fi
  fi
fi
exit "$rc"
