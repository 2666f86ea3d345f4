#!/bin/sh
# Install the edgeserve-bundle Mender Update Module and inventory script on a device (run as root):
#
#   ota/mender/install.sh --python /opt/edgeserve/bin/python [--state-dir /var/lib/edgeserve]
#                         [--config /etc/edgeserve/edgeserve.toml] [--init-mender DEVICE_TYPE] [--root DIR]
#
#   --python       the interpreter edgeserve is installed in (default: the python3 on PATH, if it has it)
#   --state-dir    the appliance's state folder, written to /etc/edgeserve/mender.toml
#   --config       the appliance's settings file (used when the module installs with no appliance running)
#   --init-mender  for a bare mender-client (Debian's package): write /var/lib/mender/device_type and
#                  /etc/mender/artifact_info when they are missing (the client refuses to install without)
#   --root         install under this folder instead of / (images, tests)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python="" state_dir="" config="" device_type="" root=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=$2; shift 2 ;;
    --state-dir) state_dir=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --init-mender) device_type=$2; shift 2 ;;
    --root) root=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$python" ]; then
  python=$(command -v python3 || true)
fi
if [ -z "$python" ] || ! "$python" -c 'import edgeserve.ota.mender_module' 2>/dev/null; then
  echo "install.sh: ${python:-python3} cannot import edgeserve; give --python PATH (the venv's python)" >&2
  exit 1
fi

install_script() {  # source, target: the interpreter filled in, 0755, replaced in one rename
  mkdir -p "$(dirname "$2")"
  sed "s|@PYTHON@|$python|" "$1" > "$2.tmp.$$"
  chmod 0755 "$2.tmp.$$"
  mv -f "$2.tmp.$$" "$2"
  echo "installed $2"
}
install_script "$here/edgeserve-bundle" "$root/usr/share/mender/modules/v3/edgeserve-bundle"
install_script "$here/mender-inventory-edgeserve" "$root/usr/share/mender/inventory/mender-inventory-edgeserve"

if [ -n "$state_dir$config" ]; then
  mkdir -p "$root/etc/edgeserve"
  {
    echo "# edgeserve-bundle Mender Update Module (written by ota/mender/install.sh)"
    [ -n "$state_dir" ] && echo "state_dir = \"$state_dir\""
    [ -n "$config" ] && echo "config = \"$config\""
    echo "busy_wait_s = 600"
  } > "$root/etc/edgeserve/mender.toml"
  echo "wrote $root/etc/edgeserve/mender.toml"
fi

if [ -n "$device_type" ]; then
  # Debian's /var/lib/mender is a link to /data/mender: make what it points to
  mkdir -p "$(readlink -m "$root/var/lib/mender")" "$root/etc/mender"
  [ -e "$root/var/lib/mender/device_type" ] || echo "device_type=$device_type" > "$root/var/lib/mender/device_type"
  [ -e "$root/etc/mender/artifact_info" ] || echo "artifact_name=edgeserve-initial" > "$root/etc/mender/artifact_info"
  echo "device type: $(cat "$root/var/lib/mender/device_type")"
fi
"$python" -m edgeserve.ota.mender_module SupportsRollback >/dev/null  # the module runs
