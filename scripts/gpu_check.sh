#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): the Megatron actor in bf16 on one GPU, in-process, last line JSON.
#
#   bash scripts/gpu_check.sh --prepare         # here (network): megatron-core's cp312 wheel into wheels/
#   bash scripts/gpu_check.sh [--small] [...]   # anywhere: the check (options: python -m scripts.gpu_check -h)
#
# On a bare GPU machine (Python 3.12, PyTorch >= 2.11 and transformers; no network) megatron-core comes from
# the wheel in wheels/, carried along with the checkout and unpacked into .gpu_check/site (a wheel is a zip
# laid out as site-packages; nothing is installed into the interpreter). With the project's .venv present, or
# an interpreter that imports megatron.core already, that one is used. PYTHON names another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

# The project's own pin (pyproject.toml), so the check runs the Megatron-Core that the suite tests.
MCORE_VERSION=$(sed -n 's/^ *"megatron-core==\([0-9][0-9.]*\)",*$/\1/p' pyproject.toml)
[ -n "$MCORE_VERSION" ] || { echo "gpu_check: pyproject.toml pins no megatron-core==X.Y.Z" >&2; exit 2; }
if [ "${1:-}" = "--prepare" ]; then
  pip=(python3 -m pip)
  [ -x .venv/bin/pip ] && pip=(.venv/bin/pip)
  "${pip[@]}" download "megatron-core==$MCORE_VERSION" --python-version 3.12 --only-binary=:all: --no-deps -d wheels/
  ls -l wheels/megatron_core-"$MCORE_VERSION"-cp312-*.whl
  exit 0
fi

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
if ! "$PY" -c 'import megatron.core' >/dev/null 2>&1; then
  wheel=$(ls wheels/megatron_core-"$MCORE_VERSION"-cp312-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    echo "gpu_check: $PY cannot import megatron.core and wheels/ holds no megatron_core-$MCORE_VERSION cp312 wheel;" \
         "run 'bash scripts/gpu_check.sh --prepare' where there is network and bring wheels/ along" >&2
    exit 2
  fi
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    echo "gpu_check: $wheel is for Python 3.12, $PY is $("$PY" -V 2>&1); set PYTHON=python3.12" >&2
    exit 2
  fi
  site=.gpu_check/site
  if [ ! -f "$site/.from-$(basename "$wheel")" ]; then
    rm -rf "$site"
    "$PY" -m zipfile -e "$wheel" "$site"
    touch "$site/.from-$(basename "$wheel")"
  fi
  export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" -m scripts.gpu_check "$@"
