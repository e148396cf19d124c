#!/usr/bin/env bash
# Install Debian packages a test suite needs, only when that is possible without asking:
#   devtools/ensure_system_packages.sh redis-server prometheus:promtool [...]
# Each argument is PACKAGE or PACKAGE:COMMAND (the command it must put on PATH; by default the
# package's own name). For each missing command: when
# running as root with apt-get available, `apt-get install -y --no-install-recommends` it
# (with one `apt-get update` first if the package is unknown). Never uses sudo, never
# prompts. Exit 0 when every command is present afterwards, 1 otherwise (the caller skips its
# suite with a message). Used by the Celery e2e suite (Redis broker), the Prometheus rule
# tests (promtool) and the alert chain suite (prometheus, prometheus-alertmanager); CI runs as
# root. Tests run these daemons as their own processes on free loopback ports, so a service a
# package starts on install (Debian's prometheus and prometheus-alertmanager do, where
# policy-rc.d allows it) is stopped and disabled again right after the install.
set -uo pipefail

find_missing() {
  missing=()
  commands=()
  for arg in "$@"; do
    pkg=${arg%%:*}
    cmd=${arg#*:}
    command -v "$cmd" >/dev/null 2>&1 || { missing+=("$pkg"); commands+=("$cmd"); }
  done
}
find_missing "$@"
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "ensure_system_packages: missing ${missing[*]}; not root, cannot apt-get install" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_system_packages: missing ${missing[*]}; no apt-get on this machine" >&2
  exit 1
fi

# One install at a time: the suites ask for their packages from parallel pytest workers, and a
# second apt-get fails at once on dpkg's lock (seen on a fresh machine: promtool skipped while
# Alertmanager installed). Then look again: the other install may have brought the command.
LOG=/tmp/ensure_system_packages.log
exec 9>/tmp/ensure_system_packages.lock
flock -w 900 9 || { echo "ensure_system_packages: another install held the lock for 900 s" >&2; exit 1; }
find_missing "$@"
[ ${#missing[@]} -eq 0 ] && exit 0
echo "== $(date -u +%FT%TZ) installing ${missing[*]}" >>"$LOG"

export DEBIAN_FRONTEND=noninteractive
apt_install() {
  # DPkg::Lock::Timeout: wait for an apt run outside this script rather than fail
  timeout 600 apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 \
    "${missing[@]}" </dev/null
}
if ! apt_install >>"$LOG" 2>&1; then
  timeout 600 apt-get update -q -o DPkg::Lock::Timeout=300 >>"$LOG" 2>&1
  if ! apt_install >>"$LOG" 2>&1; then
    echo "ensure_system_packages: apt-get install ${missing[*]} failed (see $LOG)" >&2
    exit 1
  fi
fi

# stop and disable what the install started: every init script / systemd unit of the packages
# just installed (never a service of a package that was already there)
for pkg in "${missing[@]}"; do
  while read -r unit; do
    name=$(basename "$unit"); name=${name%.service}
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      systemctl disable --now "$name" >>"$LOG" 2>&1 || true
    elif [ -x "/etc/init.d/$name" ]; then
      "/etc/init.d/$name" stop >>"$LOG" 2>&1 || true
    fi
  done < <(dpkg -L "$pkg" 2>/dev/null | grep -E '^/etc/init\.d/[^/]+$|^/(usr/)?lib/systemd/system/[^/]+\.service$' | sort -u)
done

for cmd in "${commands[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || { echo "ensure_system_packages: $cmd still missing" >&2; exit 1; }
done
exit 0
