#!/usr/bin/env bash
# Install Debian packages a test suite needs, only when that is possible without asking:
#   devtools/ensure_system_packages.sh redis-server [more packages...]
# For each missing command of the same name (redis-server -> `redis-server` on PATH): when
# running as root with apt-get available, `apt-get install -y --no-install-recommends` it
# (with one `apt-get update` first if the package is unknown). Never uses sudo, never
# prompts. Exit 0 when every command is present afterwards, 1 otherwise (the caller skips its
# suite with a message). Used by the Celery e2e suite for its Redis broker; CI runs as root.
set -uo pipefail

missing=()
for pkg in "$@"; do
  command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
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

for pkg in "${missing[@]}"; do
  command -v "$pkg" >/dev/null 2>&1 || { echo "ensure_system_packages: $pkg still missing" >&2; exit 1; }
done
exit 0
