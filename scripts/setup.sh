#!/usr/bin/env bash
# Set up omlx on a fresh Debian/Ubuntu machine (or macOS): system BLAS, a venv, the package.
# Usage: ./scripts/setup.sh            (idempotent; re-running is fast)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ]; then
  # MLX's Linux CPU wheel links a reference BLAS ~15x slower than OpenBLAS; omlx preloads this one.
  if ! ls /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
  fi
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
echo "omlx is set up: .venv/bin/omlx"
