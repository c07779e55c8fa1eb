#!/usr/bin/env bash
# Runs the test suite in .venv (installing it first when needed; a no-op when up to date).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
