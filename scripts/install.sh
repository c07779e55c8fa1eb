#!/usr/bin/env bash
# Installs polyturn with everything it needs, on Python 3.12.
#
#   bash scripts/install.sh            # creates .venv (Python 3.12) and installs into it
#   bash scripts/install.sh --system   # installs into the current interpreter (an NGC container, a conda env),
#                                      # keeping its torch (and TransformerEngine, where present)
#   bash scripts/install.sh --which-python   # prints the Python 3.12 the venv would be made with
#
# The venv's interpreter: $PYTHON if set, else python3.12 on the PATH, else pyenv's 3.12, else uv's 3.12; with
# none of them it stops with one line saying what to install. Idempotent: when the installed set already matches
# pyproject.toml (hash stamp), it returns in a second or two; a .venv of another Python is made anew.
#
# --system never replaces the installed torch: pip runs under a constraint pinning it, and a torch that
# SGLang cannot run with (sglang pins torch, see TORCH_VERSION) is refused with one line naming both versions.
#
# On a node where `nvidia-smi -L` lists GPUs it then checks the GPU path (`python -m cpu_standins
# check-install`): torch must see the GPUs, else it stops naming the driver version and the CUDA the torch
# wheel was built for (torch 2.14.1 from PyPI is built for CUDA 13.0: driver R580 or newer; TORCH_INDEX_URL,
# e.g. https://download.pytorch.org/whl/cu128, picks another build); and every GPU-path import must work
# (sgl_kernel, flash_mla, SGLang's engine, Megatron's GPT model, ray), all installed with sglang and
# megatron-core. TransformerEngine is not installed: PyPI has no binary wheel of transformer-engine-torch
# (source only, built against the local CUDA toolkit), and the workers use Megatron's local layer spec.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.14.1        # the build sglang 0.5.23 pins
TORCHVISION_VERSION=0.29.1
WANT_PY=3.12

check_gpu_path() {  # $1: the interpreter polyturn was installed into
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    "$1" -m cpu_standins check-install
  fi
}

is_py312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }

find_python() {  # prints a Python 3.12 interpreter, or nothing
  local c
  if [ -n "${PYTHON:-}" ]; then
    is_py312 "$PYTHON" && echo "$PYTHON"
    return 0
  fi
  if is_py312 "$(command -v python3.12 || true)"; then command -v python3.12; return 0; fi
  if command -v pyenv >/dev/null 2>&1; then
    for c in $(ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
      is_py312 "$c" && { echo "$c"; return 0; }
    done
  fi
  if command -v uv >/dev/null 2>&1; then
    c=$(uv python find "$WANT_PY" 2>/dev/null || true)
    is_py312 "$c" && echo "$c"
  fi
  return 0
}

stamp_of() { cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1; }

install_system() {  # into the current interpreter, keeping its torch
  local py=${PYTHON:-python3} have
  is_py312 "$py" || { echo "polyturn: --system needs Python $WANT_PY as $py (found $("$py" -V 2>&1)); set PYTHON=/path/to/python3.12" >&2; exit 2; }
  # The installed distribution's version (what pip compares), e.g. 2.14.1 or an NGC build's 2.9.0a0+50eac81.nv25.9
  have=$("$py" -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null || true)
  if [ -n "$have" ] && [ "${have%%+*}" != "$TORCH_VERSION" ]; then
    echo "polyturn: the installed torch $have cannot run sglang 0.5.23, which needs torch $TORCH_VERSION; use a container with torch $TORCH_VERSION, or a venv (bash scripts/install.sh)" >&2
    exit 2
  fi
  local constraints
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' RETURN
  # The installed torch (exact version, local label included) may be kept but never replaced; so may TE.
  if [ -n "$have" ]; then echo "torch==$have" > "$constraints"; else echo "torch==$TORCH_VERSION" > "$constraints"; fi
  "$py" -m pip install -q -e . -c "$constraints"
  "$py" -m pip check || echo "polyturn: pip check reported the conflicts above" >&2
  echo "polyturn: installed into $("$py" -c 'import sys; print(sys.prefix)') (torch ${have:-$TORCH_VERSION} kept)"
  check_gpu_path "$py"
}

case "${1:-}" in
  --system) install_system; exit 0 ;;
  --which-python) find_python; exit 0 ;;
  "") ;;
  *) echo "polyturn: unknown argument $1 (install.sh takes none, --system or --which-python)" >&2; exit 2 ;;
esac

if ! is_py312 .venv/bin/python; then
  PY=$(find_python)
  if [ -z "$PY" ] && [ -n "${PYTHON:-}" ]; then
    echo "polyturn needs Python $WANT_PY: PYTHON=$PYTHON is $("$PYTHON" -V 2>&1 || echo 'not an interpreter'); point PYTHON at a python3.12" >&2
    exit 2
  fi
  if [ -z "$PY" ]; then
    echo "polyturn needs Python $WANT_PY: install it (apt install python3.12-venv, pyenv install 3.12, or uv python install 3.12), or set PYTHON=/path/to/python3.12" >&2
    exit 2
  fi
  rm -rf .venv
  "$PY" -m venv .venv
fi
stamp=.venv/.polyturn-install-stamp
want=$(stamp_of)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "polyturn: .venv is up to date"
  check_gpu_path .venv/bin/python
  exit 0
fi

start=$(date +%s)
. .venv/bin/activate
pip install -q --upgrade pip
# torch first, pinned to the build sglang expects (taken from local disk where it lies there).
pip install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
pip install -q -e .
pip check || echo "polyturn: pip check reported the conflicts above" >&2
echo "$want" > "$stamp"
echo "polyturn: installed in $(( $(date +%s) - start )) s"
check_gpu_path .venv/bin/python
