#!/usr/bin/env bash
# Runs the test suite in .venv. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec python -m pytest -q "$@"
