# Shared set-up steps for scripts/run-agent.sh and scripts/test.sh (sourced, not run).
# Installs the Debian packages given as arguments (when missing), makes .venv, installs gpunode into it.
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
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
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
  "$VENV/bin/python" -m pip install -q --upgrade pip
  echo ">> installing gpunode$extras into $VENV"
  "$VENV/bin/python" -m pip install -q -e "$ROOT$extras"
}
