# Shared setup steps for scripts/test and scripts/demo (sourced, not run).

kvgate_apt_install() {
  # Installs Debian packages when apt-get is usable (root or sudo); silent no-op otherwise.
  local sudo=""
  if [ "$(id -u)" != 0 ]; then command -v sudo >/dev/null 2>&1 && sudo="sudo -n" || return 0; fi
  command -v apt-get >/dev/null 2>&1 || return 0
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null 2>&1 \
    || { $sudo apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null; }
}

kvgate_python() {
  local py
  for py in python3.13 python3.12 python3.11 python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "kvgate needs Python >= 3.11" >&2; return 1
}

kvgate_setup_venv() {
  # $1: extra to install ("test" or "" for the runtime only)
  local py; py=$(kvgate_python)
  if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv 2>/dev/null || { kvgate_apt_install python3-venv; "$py" -m venv .venv; }
  fi
  local stamp=.venv/.kvgate-installed-$1
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    if [ -n "$1" ]; then .venv/bin/python -m pip install -q -e ".[$1]"; else .venv/bin/python -m pip install -q -e .; fi
    touch "$stamp"
  fi
}

kvgate_ensure_redis_server() {
  # The test suite starts its own redis-server on a free port; it only needs the binary.
  command -v redis-server >/dev/null 2>&1 || kvgate_apt_install redis-server || true
  command -v redis-server >/dev/null 2>&1 || echo "warning: redis-server not installed; Redis tests will skip" >&2
}
