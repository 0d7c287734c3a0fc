#!/usr/bin/env bash
# Set up omlx on a fresh Debian/Ubuntu machine (or macOS): system BLAS, a venv, the package.
# Usage: ./scripts/setup.sh            (idempotent; re-running is fast)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ]; then
  # MLX's Linux CPU wheel links a reference BLAS ~15x slower than OpenBLAS; omlx preloads this one.
  # ruby: `ruby -c Formula/omlx.rb` in tests/unit/test_formula.py.
  # iproute2 (`ip netns`, veth, bridge): the cluster tests' network namespaces.
  # chromium + chromium-driver: the /admin dashboard test (tests/integration/test_dashboard.py).
  if ! ls /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1 || ! command -v ruby >/dev/null 2>&1 \
      || ! command -v ip >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1 \
      || ! command -v chromedriver >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread ruby iproute2 chromium chromium-driver >/dev/null
  fi
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# Real client CLIs for the integration tests (clients/package.json, pinned by its lock file).
# Reinstalled only when the lock file changed since the last install; skipped without npm.
if command -v npm >/dev/null 2>&1; then
  if ! cmp -s clients/package-lock.json clients/node_modules/.omlx-installed-lock 2>/dev/null; then
    npm ci --prefix clients --no-audit --no-fund --loglevel=error
    cp clients/package-lock.json clients/node_modules/.omlx-installed-lock
  fi
else
  echo "npm not found: client CLI tests (Codex, Claude Code) will be skipped" >&2
fi
echo "omlx is set up: .venv/bin/omlx"
