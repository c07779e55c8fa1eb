#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs polyturn with everything it needs. Idempotent: when the
# installed set already matches pyproject.toml (hash stamp), it returns in a second or two.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"polyturn needs Python 3.11, found {sys.version}"'

[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.polyturn-install-stamp
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "polyturn: .venv is up to date"
  exit 0
fi

start=$(date +%s)
. .venv/bin/activate
pip install -q --upgrade pip
# torch first, pinned to the build sglang 0.5.23 expects (taken from local disk where it lies there).
pip install -q torch==2.14.1 torchvision==0.29.1
pip install -q -e .
pip check || echo "polyturn: pip check reported the conflicts above" >&2
echo "$want" > "$stamp"
echo "polyturn: installed in $(( $(date +%s) - start )) s"
