# Shared set-up steps for scripts/run-agent.sh and scripts/test.sh (sourced, not run).
# Installs the Debian packages given as arguments (when missing; waiting for another apt that holds the
# dpkg lock), makes .venv, installs gpunode into it (again only when its packaging or native sources changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GPUNODE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "need root (or sudo) to run: $*" >&2; return 1; fi
}

ensure_apt_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo ">> installing Debian packages: ${missing[*]}"
    apt_lock_notice
    # Another apt (unattended-upgrades on a fresh cloud VM) may hold the locks: wait for it, do not fail.
    local wait=(-o "DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT")
    as_root env DEBIAN_FRONTEND=noninteractive apt-get "${wait[@]}" update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get "${wait[@]}" install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
}

APT_LOCK_TIMEOUT="${GPUNODE_APT_LOCK_TIMEOUT:-600}"  # seconds to wait for another apt or dpkg

# Say so when another apt or dpkg holds its locks (apt-get then waits up to APT_LOCK_TIMEOUT seconds).
apt_lock_notice() {
  command -v fuser >/dev/null || return 0
  local locks=(/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock)
  if as_root fuser "${locks[@]}" >/dev/null 2>&1; then
    echo ">> another apt or dpkg is running (often unattended-upgrades on a fresh VM):" \
      "waiting up to ${APT_LOCK_TIMEOUT}s for it to finish"
  fi
}

# What an installed gpunode was built from: its packaging and native sources, the extras, the Python.
install_stamp() {
  local extras="$1"
  {
    (cd "$ROOT" && find pyproject.toml setup.py native -type f -not -path '*/__pycache__/*' -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum)
    echo "extras $extras"
    "$VENV/bin/python" --version 2>&1
  } | sha256sum | cut -d' ' -f1
}

# One stamp per set of extras, so scripts asking for different extras do not undo each other's stamp.
stamp_file() {
  local name="${1//[^A-Za-z0-9,_-]/}"
  echo "$VENV/.gpunode-install-stamp${name:+-$name}"
}

# Whether the editable install in $VENV is current: same stamp, and its entry point and native parts exist.
install_is_current() {
  local file
  file="$(stamp_file "$2")"
  [ -f "$file" ] && [ "$(cat "$file")" = "$1" ] && [ -x "$VENV/bin/gpunode" ] &&
    [ -f "$ROOT/gpunode/lib/libgpunode-preload.so" ] && compgen -G "$ROOT/gpunode/_memcap*.so" >/dev/null
}

ensure_venv() {
  local extras="$1"
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "gpunode needs Python >= 3.11 (found $("$PYTHON" --version 2>&1))" >&2; exit 1
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    echo ">> creating $VENV"
    "$PYTHON" -m venv "$VENV" 2>/dev/null || { ensure_apt_packages python3-venv; "$PYTHON" -m venv "$VENV"; }
  fi
  local stamp
  stamp="$(install_stamp "$extras")"
  if install_is_current "$stamp" "$extras"; then
    echo ">> gpunode$extras in $VENV is up to date (packaging and native sources unchanged)"
    return 0
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
  echo ">> installing gpunode$extras into $VENV"
  rm -f "$(stamp_file "$extras")"
  "$VENV/bin/python" -m pip install -q -e "$ROOT$extras"
  echo "$stamp" >"$(stamp_file "$extras")"
}
