#!/usr/bin/env bash
# Set everything up, then run the default test suite (unit + integration; `slow` excluded).
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
