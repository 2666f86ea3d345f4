#!/usr/bin/env bash
# Prove the ARM64 (aarch64) install of edgeserve for real, on an x86-64 host, under QEMU user-mode
# emulation: a Debian bookworm arm64 root made with `debootstrap --foreign`, its second stage run in a
# chroot through binfmt_misc + qemu-aarch64-static, python3 (3.11) + venv inside it, then edgeserve
# installed with pip from a wheel of this checkout (extras: onnxruntime, samples), `edgeserve detect`,
# `edgeserve samples --no-ppocr` (the tiny MLP) and a server on it answering one JSON inference.
#
#   sudo bash scripts/arm64-check.sh [WORKDIR]        # default WORKDIR: /var/tmp/edgeserve-arm64
#
# Environment:
#   EDGESERVE_ARM64_WORKDIR   work folder (same as the argument)
#   EDGESERVE_ARM64_MIRROR    Debian mirror for debootstrap (default: the one this host's apt uses)
#   EDGESERVE_ARM64_CMD       run | serve   (default run: the supervisor; serve: one process)
#   EDGESERVE_ARM64_HTTP_PORT / EDGESERVE_ARM64_GRPC_PORT   (default 18000 / 18001)
#   EDGESERVE_ARM64_READY_TIMEOUT   seconds to wait for /v2/health/ready (default 900)
#   EDGESERVE_ARM64_FRESH=1   throw the arm64 root away and start again
#   EDGESERVE_ARM64_RUNNER    auto | chroot | proot   (default auto: chroot through binfmt_misc when
#                             qemu-aarch64 can be registered there, else proot -q qemu-aarch64-static,
#                             which emulates every exec itself and needs no binfmt_misc)
#
# Needs root (debootstrap, chroot, mount), apt (installs debootstrap, qemu-user-static and
# binfmt-support when missing, proot when it is the runner) and network access to a Debian mirror and to PyPI. Idempotent: a
# finished root is reused (marker WORKDIR/root.done); the edgeserve wheel is rebuilt from the tree
# as it is now and reinstalled on every run; pip's cache lives inside the root.
# Exits non-zero, naming the step, on the first failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD

WORK=${1:-${EDGESERVE_ARM64_WORKDIR:-/var/tmp/edgeserve-arm64}}
ROOT=$WORK/root
SUITE=bookworm
CMD=${EDGESERVE_ARM64_CMD:-run}
RUNNER=${EDGESERVE_ARM64_RUNNER:-auto}
HTTP_PORT=${EDGESERVE_ARM64_HTTP_PORT:-18000}
GRPC_PORT=${EDGESERVE_ARM64_GRPC_PORT:-18001}
READY_TIMEOUT=${EDGESERVE_ARM64_READY_TIMEOUT:-900}
VENV=/opt/edgeserve            # inside the arm64 root
MODELS=/srv/edgeserve/models   # inside the arm64 root

T0=$(date +%s)
STEP=""
STEP_T0=0
SUMMARY=()
SERVER_PID=""

now() { date +%s; }
log() { printf '[arm64-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
step_end() {
  if [ -n "$STEP" ]; then
    local d=$(($(now) - STEP_T0))
    SUMMARY+=("$(printf '%6ss  %s' "$d" "$STEP")")
    log "done in ${d}s: $STEP"
  fi
  STEP=""
}
step() {
  step_end
  STEP=$1
  STEP_T0=$(now)
  log "==> $STEP"
}
fail() {
  log "FAILED at step: ${STEP:-setup}: $*" >&2
  exit 1
}
print_summary() {
  local total=$(($(now) - T0))
  echo "---- arm64-check timings ----"
  local line
  for line in "${SUMMARY[@]+"${SUMMARY[@]}"}"; do echo "$line"; done
  printf '%6ss  total\n' "$total"
}

# ---- mounts inside the root (always undone on exit) ----------------------------------------------
MOUNTED=()
HOST_CA=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}
ROOT_CA=/etc/ssl/certs/edgeserve-check-host-ca.crt # inside the root
mount_root() {
  # pip inside the root resolves pypi.org with the host's resolver settings and trusts what the
  # host trusts (a TLS-inspecting proxy's CA, as pip on the host does).
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
  if [ -f "$HOST_CA" ]; then mkdir -p "$ROOT/etc/ssl/certs" && cp -L "$HOST_CA" "$ROOT$ROOT_CA"; fi
  [ "$RUNNER" = chroot ] || return 0 # proot binds /dev, /proc and /sys itself
  local target
  for target in proc sys dev; do
    mkdir -p "$ROOT/$target"
    if ! mountpoint -q "$ROOT/$target"; then
      case $target in
        proc) mount -t proc proc "$ROOT/proc" ;;
        sys) mount -t sysfs sysfs "$ROOT/sys" ;;
        # /dev with its submounts (/dev/shm, /dev/pts), as a slave: nothing mounted under the root
        # can propagate back to the host's /dev.
        dev) mount --rbind /dev "$ROOT/dev" && mount --make-rslave "$ROOT/dev" ;;
      esac
      MOUNTED+=("$ROOT/$target")
    fi
  done
}
# qemu-user before 8.1 passes the host's /proc/cpuinfo (x86) through to the arm64 programs.
# onnxruntime's CPU probe (pytorch/cpuinfo) parses it at import, finds no ARM "CPU part" lines and
# crashes (SIGSEGV, NULL pointer): over /proc/cpuinfo in the root goes the cpuinfo an arm64 Linux
# shows (one Neoverse-N1 / Graviton2 entry per host core, features that qemu's "max" CPU has).
fake_cpuinfo() {
  local f=$WORK/cpuinfo.arm64 i
  : >"$f"
  for ((i = 0; i < $(nproc); i++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' "$i" >>"$f"
  done
  echo "$f"
}
CPUINFO_BIND=()
bind_in_root() { # FILE PATH-IN-ROOT
  if [ "$RUNNER" = proot ]; then
    CPUINFO_BIND+=(-b "$1:$2")
  else
    mount --bind "$1" "$ROOT$2" || fail "could not bind $1 over $ROOT$2"
    MOUNTED+=("$ROOT$2")
  fi
}
arm_proc() { # after mount_root: the arm64 view of /proc that qemu-user does not give
  if root_exec /usr/bin/grep -q '^CPU implementer' /proc/cpuinfo; then
    log "/proc/cpuinfo in the root: ARM (qemu emulates it)"
  else
    bind_in_root "$(fake_cpuinfo)" /proc/cpuinfo
    log "/proc/cpuinfo in the root: the host's (qemu $(qemu-aarch64-static --version | awk 'NR==1 {print $3}') passes it through); bound an arm64 one over it ($WORK/cpuinfo.arm64), else onnxruntime's import segfaults"
  fi
  # The kernel stays the host's: /proc/sys/kernel/arch says x86_64, and edgeserve's hardware probe
  # takes the architecture from there (device profile x86-cpu instead of arm-cpu). An arm64 kernel
  # says aarch64; so does the file bound over it here.
  local karch
  karch=$(root_exec /usr/bin/cat /proc/sys/kernel/arch 2>/dev/null || true)
  if [ -n "$karch" ] && [ "$karch" != aarch64 ]; then
    echo aarch64 >"$WORK/kernel-arch.arm64"
    bind_in_root "$WORK/kernel-arch.arm64" /proc/sys/kernel/arch
    log "/proc/sys/kernel/arch in the root: the host kernel's ($karch); bound 'aarch64' over it"
  fi
}
umount_root() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    umount -R "${MOUNTED[$i]}" 2>/dev/null || umount -R -l "${MOUNTED[$i]}" 2>/dev/null || true
  done
  MOUNTED=()
}
children_of() { # PID -> its child processes (from /proc, no procps needed)
  local f
  for f in /proc/[0-9]*/stat; do
    awk -v p="$1" '{ sub(/^.*\) /, ""); if ($2 == p) { split(FILENAME, a, "/"); print a[3] } }' "$f" 2>/dev/null
  done
}
alive() { # PID -> running (an exited child stays a zombie until `wait`; kill -0 succeeds on it)
  local st
  st=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
  [ -n "$st" ] && [ "$st" != Z ]
}
SERVER_RC=""
stop_server() { # SIGTERM, up to 60 s for a graceful exit, then SIGKILL; sets SERVER_RC
  if [ -n "$SERVER_PID" ] && alive "$SERVER_PID"; then
    if [ "$RUNNER" = proot ]; then
      # proot traces the server: SIGTERM goes to the emulated edgeserve process itself.
      local child
      for child in $(children_of "$SERVER_PID"); do kill -TERM "$child" 2>/dev/null || true; done
    else
      # chroot exec'd env, env exec'd edgeserve: this pid is the (emulated) edgeserve process.
      kill -TERM "$SERVER_PID" 2>/dev/null || true
    fi
    local i
    for i in $(seq 1 60); do
      alive "$SERVER_PID" || break
      sleep 1
    done
    if alive "$SERVER_PID"; then
      log "server did not stop in 60 s after SIGTERM; SIGKILL" >&2
      kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
  fi
  if [ -n "$SERVER_PID" ]; then
    SERVER_RC=0
    wait "$SERVER_PID" 2>/dev/null || SERVER_RC=$?
  fi
  SERVER_PID=""
}
cleanup() {
  local rc=$?
  trap - EXIT
  stop_server
  umount_root
  step_end
  print_summary
  if [ "$rc" -eq 0 ]; then log "OK: edgeserve installs and serves on linux/arm64 (emulated)"; else log "FAILED (exit $rc)" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Run an arm64 program inside the root: chroot (binfmt_misc runs it under qemu, and every program it
# starts), or proot, which runs qemu-aarch64-static on each exec itself (-0: uid 0 to the programs).
root_prefix() { # sets ROOT_CMD
  if [ "$RUNNER" = proot ]; then
    ROOT_CMD=(proot -0 -q qemu-aarch64-static -r "$ROOT" -b /dev -b /proc -b /sys -b /etc/resolv.conf
      "${CPUINFO_BIND[@]+"${CPUINFO_BIND[@]}"}" -w /)
  else
    ROOT_CMD=(chroot "$ROOT")
  fi
}
root_exec() {
  root_prefix
  "${ROOT_CMD[@]}" "$@"
}
# ROOT_CMD + a clean environment (the host's PIP_* settings and paths must not leak in), except the
# host's proxy settings and CA bundle. Sets IN_ROOT.
in_root_prefix() {
  local pass=() v
  for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
    [ -z "${!v:-}" ] || pass+=("$v=${!v}")
  done
  [ ! -f "$ROOT$ROOT_CA" ] || pass+=("PIP_CERT=$ROOT_CA" "SSL_CERT_FILE=$ROOT_CA" "REQUESTS_CA_BUNDLE=$ROOT_CA")
  root_prefix
  IN_ROOT=("${ROOT_CMD[@]}" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb "${pass[@]+"${pass[@]}"}"
    "PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180)
}
in_root() {
  in_root_prefix
  "${IN_ROOT[@]}" "$@"
}

# ---- 1. host tools --------------------------------------------------------------------------------
step "host: root, apt tools (debootstrap, qemu-user-static, binfmt-support)"
[ "$(id -u)" -eq 0 ] || fail "needs root (debootstrap, chroot and mount); run it with sudo"
[ "$(uname -m)" = "x86_64" ] || [ "$(uname -m)" = "aarch64" ] || log "host is $(uname -m); continuing"
missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
command -v update-binfmts >/dev/null || missing+=(binfmt-support)
if [ "${#missing[@]}" -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  command -v apt-get >/dev/null || fail "apt-get not found; install ${missing[*]} by hand"
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null || fail "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
    || fail "apt-get install ${missing[*]} failed"
fi
log "$(qemu-aarch64-static --version | head -1); debootstrap $(dpkg-query -W -f '${Version}' debootstrap 2>/dev/null || echo '?')"

# Debian mirror: the one this host's apt uses (deb822 .sources or one-line .list), else deb.debian.org.
mirror_from_apt() {
  local f
  for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    case $f in
      *.sources) awk 'tolower($1)=="uris:" {for (i=2;i<=NF;i++) if ($i ~ /\/debian\/?$/) {print $i; exit}}' "$f" ;;
      *) awk '$1=="deb" {for (i=2;i<=NF;i++) if ($i ~ /^(https?|file):/ && $i ~ /\/debian\/?$/) {print $i; exit}}' "$f" ;;
    esac
  done | head -1
}
MIRROR=${EDGESERVE_ARM64_MIRROR:-$(mirror_from_apt)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
log "Debian mirror: $MIRROR"

# ---- 2. binfmt_misc (or proot) -------------------------------------------------------------------
BINFMT=/proc/sys/fs/binfmt_misc
BINFMT_WHY=""
BINFMT_FLAGS=""
BINFMT_INTERP=""
register_binfmt() { # sets BINFMT_WHY when arm64 ELF files cannot be run through binfmt_misc
  if [ ! -e "$BINFMT/register" ] && ! mount -t binfmt_misc binfmt_misc "$BINFMT" 2>/dev/null; then
    BINFMT_WHY="binfmt_misc is not mounted at $BINFMT and mounting it failed (a container without CAP_SYS_ADMIN, or a kernel without CONFIG_BINFMT_MISC)"
    return
  fi
  [ -e "$BINFMT/qemu-aarch64" ] || update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  if [ ! -e "$BINFMT/qemu-aarch64" ] && [ -x /lib/systemd/systemd-binfmt ] && [ -f /usr/lib/binfmt.d/qemu-aarch64.conf ]; then
    /lib/systemd/systemd-binfmt /usr/lib/binfmt.d/qemu-aarch64.conf >/dev/null 2>&1 || true
  fi
  if [ ! -e "$BINFMT/qemu-aarch64" ]; then
    # Register by hand: aarch64 ELF magic/mask (as qemu's qemu-binfmt-conf.sh), fix-binary (F) so
    # the kernel opens the interpreter now and it works inside the chroot, P keeps argv[0], C setuid.
    printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:FPC' \
      >"$BINFMT/register" 2>/dev/null || true
  fi
  if [ ! -e "$BINFMT/qemu-aarch64" ]; then
    BINFMT_WHY="qemu-aarch64 could not be registered in $BINFMT (read-only or not permitted)"
    return
  fi
  if ! grep -q '^enabled' "$BINFMT/qemu-aarch64" && ! { echo 1 >"$BINFMT/qemu-aarch64"; } 2>/dev/null; then
    BINFMT_WHY="the qemu-aarch64 entry in $BINFMT is disabled and cannot be enabled"
    return
  fi
  BINFMT_INTERP=$(awk '$1=="interpreter" {print $2}' "$BINFMT/qemu-aarch64")
  BINFMT_FLAGS=$(awk '$1=="flags:" {print $2}' "$BINFMT/qemu-aarch64")
}
case $RUNNER in
  auto | chroot)
    step "host: binfmt_misc registration for aarch64 ELF (qemu-aarch64)"
    register_binfmt
    if [ -z "$BINFMT_WHY" ]; then
      RUNNER=chroot
      log "binfmt qemu-aarch64: interpreter $BINFMT_INTERP, flags $BINFMT_FLAGS; runner: chroot"
    elif [ "$RUNNER" = chroot ]; then
      fail "$BINFMT_WHY: arm64 programs cannot run in a chroot here. Use EDGESERVE_ARM64_RUNNER=proot, or register qemu-aarch64 on the host (docker run --privileged --rm tonistiigi/binfmt --install arm64)"
    else
      log "no binfmt_misc: $BINFMT_WHY; falling back to proot -q qemu-aarch64-static"
      RUNNER=proot
    fi
    ;;
  proot) ;;
  *) fail "EDGESERVE_ARM64_RUNNER must be auto, chroot or proot, not '$RUNNER'" ;;
esac
if [ "$RUNNER" = proot ]; then
  step "host: proot (runs every arm64 exec under qemu-aarch64-static, no binfmt_misc)"
  if ! command -v proot >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends proot >/dev/null \
      || fail "apt-get install proot failed"
  fi
  log "$(proot --version 2>&1 | grep -m1 -io 'proot v[0-9.]*' || echo proot)"
fi

# proot must translate the paths of every file syscall qemu makes for the guest; bookworm's arm64
# glibc uses statx and faccessat2, which proot 5.1.0 (Debian bookworm's) does not know: the file is
# then looked up on the host and "does not exist" although `ls /` lists it.
proot_probe() {
  [ "$RUNNER" = proot ] || return 0
  # A file only the root has (a path the host also has would be found on the host).
  local probe=/.edgeserve-proot-probe ok=1
  install -m 0755 /dev/null "$ROOT$probe"
  root_exec /usr/bin/test -x "$probe" 2>/dev/null && root_exec /usr/bin/stat "$probe" >/dev/null 2>&1 || ok=0
  rm -f "$ROOT$probe"
  if [ "$ok" = 0 ]; then
    fail "proot $(dpkg-query -W -f '${Version}' proot 2>/dev/null || echo '?') does not translate the statx/faccessat2 syscalls that the arm64 glibc makes under qemu-aarch64-static: files in the root look missing (test -x / stat fail while ls lists them), so debootstrap and python cannot run. Use the chroot runner (binfmt_misc: needs CAP_SYS_ADMIN to mount it, or a host that has qemu-aarch64 registered with the F flag), or a proot that knows statx and faccessat2"
  fi
}

# ---- 3. the arm64 root ----------------------------------------------------------------------------
if [ "${EDGESERVE_ARM64_FRESH:-0}" = "1" ] && [ -d "$ROOT" ]; then
  step "remove the old arm64 root (EDGESERVE_ARM64_FRESH=1)"
  if findmnt -rn -o TARGET | grep -q "^$ROOT/"; then fail "something is still mounted under $ROOT; unmount it first"; fi
  rm -rf "$ROOT" "$WORK/root.done"
fi
mkdir -p "$WORK"
if [ -f "$WORK/root.done" ] && [ -x "$ROOT/usr/bin/python3" ]; then
  step "arm64 root: reuse $ROOT (finished before)"
else
  if [ -d "$ROOT" ]; then
    # An unfinished root (interrupted debootstrap) is thrown away: the second stage is not restartable.
    if findmnt -rn -o TARGET | grep -q "^$ROOT/"; then fail "something is still mounted under $ROOT; unmount it first"; fi
    step "arm64 root: remove an unfinished root"
    rm -rf "$ROOT"
  fi
  step "debootstrap --arch=arm64 --foreign (first stage: download + unpack, on the host)"
  debootstrap --arch=arm64 --foreign --variant=minbase \
    --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$ROOT" "$MIRROR" >"$WORK/debootstrap-1.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap-1.log" >&2; fail "debootstrap first stage failed (log: $WORK/debootstrap-1.log)"; }
  # With the F flag the kernel already holds the interpreter; without it the path must exist inside.
  if [ "$RUNNER" = chroot ]; then
    case $BINFMT_FLAGS in
      *F*) ;;
      *) mkdir -p "$ROOT$(dirname "$BINFMT_INTERP")"; cp "$BINFMT_INTERP" "$ROOT$BINFMT_INTERP" ;;
    esac
  fi
  if [ "$RUNNER" = proot ] && [ -L "$ROOT/proc" ]; then
    # debootstrap in a Docker-like host leaves proc -> /proc; proot cannot bind /proc onto that.
    rm "$ROOT/proc" && mkdir "$ROOT/proc"
  fi
  step "debootstrap --second-stage (inside the root, emulated arm64, runner: $RUNNER)"
  root_exec /usr/bin/uname -m | grep -qx aarch64 \
    || fail "an arm64 binary did not run in the root (qemu via $RUNNER not working)"
  proot_probe
  mount_root
  root_exec /debootstrap/debootstrap --second-stage >"$WORK/debootstrap-2.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap-2.log" >&2; fail "debootstrap second stage failed (log: $WORK/debootstrap-2.log)"; }
  umount_root
  touch "$WORK/root.done"
fi

mount_root
step "arm64 root: check the emulated machine"
proot_probe
arm_proc
log "uname -m in the root: $(in_root uname -m)"
[ "$(in_root uname -m)" = aarch64 ] || fail "the root does not run as aarch64"
# shellcheck disable=SC2016  # $PRETTY_NAME expands inside the root, not here
log "$(in_root sh -c '. /etc/os-release; echo "$PRETTY_NAME"'), $(in_root python3 --version)"

# ---- 4. edgeserve wheel from this checkout (on the host) ------------------------------------------
step "host: build the edgeserve wheel from this tree (pip wheel --no-deps)"
HOST_PY=python3
[ -x "$REPO/.venv/bin/python" ] && HOST_PY=$REPO/.venv/bin/python
rm -rf "$WORK/dist" "$WORK/wheel-build"
# Build from a copy of the tracked + untracked (not ignored) files: the tree as it is now, without
# .venv, build/ or egg-info leftovers.
mkdir -p "$WORK/wheel-build"
(git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done) | tar --null -T - -cf - | tar -xf - -C "$WORK/wheel-build"
"$HOST_PY" -m pip wheel --no-deps --no-build-isolation -q -w "$WORK/dist" "$WORK/wheel-build" >"$WORK/wheel.log" 2>&1 \
  || "$HOST_PY" -m pip wheel --no-deps -q -w "$WORK/dist" "$WORK/wheel-build" >>"$WORK/wheel.log" 2>&1 \
  || { tail -20 "$WORK/wheel.log" >&2; fail "pip wheel failed (log: $WORK/wheel.log)"; }
wheels=("$WORK"/dist/edgeserve-*.whl)
WHEEL=${wheels[0]}
[ -f "$WHEEL" ] || fail "no wheel in $WORK/dist"
log "wheel: $(basename "$WHEEL") ($(git -C "$REPO" rev-parse --short HEAD)$(git -C "$REPO" diff --quiet HEAD -- edgeserve pyproject.toml || echo ', with uncommitted changes'))"
rm -rf "$ROOT/tmp/edgeserve-dist"
mkdir -p "$ROOT/tmp/edgeserve-dist"
cp "$WHEEL" "$ROOT/tmp/edgeserve-dist/"
WHEEL_IN=/tmp/edgeserve-dist/$(basename "$WHEEL")

# ---- 5. pip install inside the root ---------------------------------------------------------------
step "arm64: python3 -m venv $VENV"
[ -x "$ROOT$VENV/bin/python" ] || in_root python3 -m venv "$VENV" || fail "python3 -m venv failed"
step "arm64: pip install edgeserve[onnxruntime,samples] (aarch64 wheels from PyPI)"
pip_fail() {
  tail -20 "$WORK/pip.log" >&2
  if grep -q CERTIFICATE_VERIFY_FAILED "$WORK/pip.log"; then
    fail "$1: TLS to PyPI not trusted inside the root (a TLS-inspecting proxy? its CA must be in $HOST_CA, or set PIP_CERT on the host) (log: $WORK/pip.log)"
  fi
  fail "$1 (log: $WORK/pip.log)"
}
in_root "$VENV/bin/python" -m pip install -q --upgrade pip >"$WORK/pip.log" 2>&1 \
  || pip_fail "pip install --upgrade pip failed"
grep -q CERTIFICATE_VERIFY_FAILED "$WORK/pip.log" && pip_fail "PyPI unreachable from the root"
in_root "$VENV/bin/python" -m pip install --prefer-binary "${WHEEL_IN}[onnxruntime,samples]" >>"$WORK/pip.log" 2>&1 \
  || pip_fail "pip install of edgeserve[onnxruntime,samples] failed (a dependency without an aarch64 wheel would need a compiler, which the root does not have)"
# The wheel's version does not change between trees: reinstall edgeserve itself every time.
in_root "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$WHEEL_IN" >>"$WORK/pip.log" 2>&1 \
  || pip_fail "pip reinstall of the edgeserve wheel failed"
versions=$(in_root "$VENV/bin/python" -c 'import platform, numpy, onnxruntime, onnx, grpc, zmq; print(f"python {platform.python_version()} ({platform.machine()}), onnxruntime {onnxruntime.__version__} {onnxruntime.get_available_providers()}, onnx {onnx.__version__}, numpy {numpy.__version__}, grpcio {grpc.__version__}, pyzmq {zmq.__version__}")') \
  || fail "importing numpy/onnxruntime/onnx/grpc/zmq in the arm64 venv failed"
log "$versions"
in_root "$VENV/bin/python" -m pip list --format=freeze >"$WORK/pip-freeze.txt" 2>/dev/null || true

# ---- 6. edgeserve detect / samples ----------------------------------------------------------------
# The wheel does not carry the device profiles (devices/*.toml); Dockerfile.arm64 puts them in
# /usr/share/edgeserve/devices, one of the folders edgeserve reads: the same here.
rm -rf "$ROOT/usr/share/edgeserve/devices"
mkdir -p "$ROOT/usr/share/edgeserve/devices"
cp "$REPO"/devices/*.toml "$ROOT/usr/share/edgeserve/devices/"
step "arm64: edgeserve detect"
in_root "$VENV/bin/edgeserve" detect --model-repository "$MODELS" | tee "$WORK/detect.txt" \
  || fail "edgeserve detect failed"
step "arm64: edgeserve samples --no-ppocr (builds the MLP with onnx)"
mkdir -p "$ROOT$MODELS/mlp"
cp "$REPO/models/mlp/config.pbtxt" "$ROOT$MODELS/mlp/config.pbtxt"
rm -f "$ROOT$MODELS/mlp/1/model.onnx"
in_root "$VENV/bin/edgeserve" samples --model-repository "$MODELS" --no-ppocr || fail "edgeserve samples failed"
[ -s "$ROOT$MODELS/mlp/1/model.onnx" ] || fail "no $MODELS/mlp/1/model.onnx after edgeserve samples"

# ---- 7. serve, wait for ready, one inference ------------------------------------------------------
http_code() { # URL -> HTTP status (000 when nothing answers); host python, no curl needed
  python3 - "$1" <<'EOF' 2>/dev/null || echo 000
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        print(r.status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print("000")
EOF
}
step "arm64: edgeserve $CMD on the MLP, wait for /v2/health/ready"
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# The chroot shares the host's network: a port taken on the host is taken for the server too. The
# defaults move to free ports then; ports set explicitly must be free.
if port_busy "$HTTP_PORT"; then
  [ -z "${EDGESERVE_ARM64_HTTP_PORT:-}" ] || fail "port $HTTP_PORT (EDGESERVE_ARM64_HTTP_PORT) is already in use on this host"
  HTTP_PORT=$(free_port)
fi
if port_busy "$GRPC_PORT" || [ "$GRPC_PORT" = "$HTTP_PORT" ]; then
  [ -z "${EDGESERVE_ARM64_GRPC_PORT:-}" ] || fail "port $GRPC_PORT (EDGESERVE_ARM64_GRPC_PORT) is already in use on this host"
  GRPC_PORT=$(free_port)
fi
log "ports: HTTP $HTTP_PORT, gRPC $GRPC_PORT"
# Started as a plain command, not through a shell function, so that $! is the server itself
# (chroot and env exec it) and SIGTERM reaches it.
in_root_prefix
"${IN_ROOT[@]}" "$VENV/bin/edgeserve" "$CMD" --model-repository "$MODELS" --no-zmq --load-model mlp \
  --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
ready=0
deadline=$(($(now) + READY_TIMEOUT))
while [ "$(now)" -lt "$deadline" ]; do
  if ! alive "$SERVER_PID"; then
    tail -30 "$WORK/server.log" >&2
    fail "the server exited before it was ready (log: $WORK/server.log)"
  fi
  if [ "$(http_code "http://127.0.0.1:$HTTP_PORT/v2/health/ready")" = 200 ]; then ready=1; break; fi
  sleep 2
done
[ "$ready" = 1 ] || { tail -30 "$WORK/server.log" >&2; fail "not ready after ${READY_TIMEOUT}s (log: $WORK/server.log)"; }
log "ready after $(($(now) - STEP_T0))s"

step "arm64: POST /v2/models/mlp/infer (JSON, INPUT0 FP32 [1,16]) -> OUTPUT0 [1,4]"
python3 - "http://127.0.0.1:$HTTP_PORT/v2/models/mlp/infer" <<'EOF' | tee "$WORK/infer.json" || fail "the inference failed or returned the wrong shape"
import json, sys, urllib.request
body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                    "data": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]]}]}
req = urllib.request.Request(sys.argv[1], data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    reply = json.load(r)
print(json.dumps(reply))
out = {o["name"]: o for o in reply["outputs"]}["OUTPUT0"]
assert out["datatype"] == "FP32", out
assert out["shape"] == [1, 4], out
assert len(out["data"]) == 4 and abs(sum(out["data"]) - 1.0) < 1e-4, out  # softmax scores
print(f"OUTPUT0 shape {out['shape']}, sum {sum(out['data']):.6f}", file=sys.stderr)
EOF

step "arm64: stop the server (SIGTERM), expect a graceful exit 0"
stop_server
log "server log tail:"
tail -5 "$WORK/server.log" | sed 's/^/    /'
[ "$SERVER_RC" = 0 ] || fail "edgeserve $CMD exited with $SERVER_RC after SIGTERM (log: $WORK/server.log)"
log "edgeserve $CMD exited 0 after SIGTERM"
