#!/usr/bin/env bash
# Install Debian packages a test suite needs, only when that is possible without asking:
#   devtools/ensure_system_packages.sh redis-server prometheus:promtool [...]
# Each argument is PACKAGE or PACKAGE:COMMAND (the command it must put on PATH; by default the
# package's own name). For each missing command: when
# running as root with apt-get available, `apt-get install -y --no-install-recommends` it
# (with one `apt-get update` first if the package is unknown). Never uses sudo, never
# prompts. Exit 0 when every command is present afterwards, 1 otherwise (the caller skips its
# suite with a message). Used by the Celery e2e suite (Redis broker) and the Prometheus rule
# tests (promtool); CI runs as root.
set -uo pipefail

missing=()
commands=()
for arg in "$@"; do
  pkg=${arg%%:*}
  cmd=${arg#*:}
  command -v "$cmd" >/dev/null 2>&1 || { missing+=("$pkg"); commands+=("$cmd"); }
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "ensure_system_packages: missing ${missing[*]}; not root, cannot apt-get install" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_system_packages: missing ${missing[*]}; no apt-get on this machine" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt_install() {
  timeout 600 apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
}
if ! apt_install >/tmp/ensure_system_packages.log 2>&1; then
  timeout 600 apt-get update -q >>/tmp/ensure_system_packages.log 2>&1
  if ! apt_install >>/tmp/ensure_system_packages.log 2>&1; then
    echo "ensure_system_packages: apt-get install ${missing[*]} failed (see /tmp/ensure_system_packages.log)" >&2
    exit 1
  fi
fi

for cmd in "${commands[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || { echo "ensure_system_packages: $cmd still missing" >&2; exit 1; }
done
exit 0
