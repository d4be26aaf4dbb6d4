#!/usr/bin/env bash
# Install what tests/browser needs: Debian's Chromium and its chromedriver (apt) and Python selenium
# (pip, into the venv given as $1, default .venv). Idempotent: a second run only checks and returns.
#
#   tests/browser/install_browser.sh [VENV]
#
# Nothing here downloads a browser outside the distribution's packages: selenium is pointed at
# /usr/bin/chromium and /usr/bin/chromedriver by the test, and its selenium-manager is never used.
set -euo pipefail

VENV="${1:-.venv}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
  echo "install_browser.sh: no Python at $PY; create the venv first (make test) or pass its path" >&2
  exit 2
fi

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  echo "chromium and chromedriver already installed: $(/usr/bin/chromium --version 2>/dev/null || true)"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_browser.sh: need root or sudo for apt-get" >&2; exit 2; }
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver
fi

if "$PY" -c "import selenium" 2>/dev/null; then
  echo "selenium already installed: $("$PY" -c 'import selenium; print(selenium.__version__)')"
else
  "$PY" -m pip install --quiet "selenium>=4.11"
fi
