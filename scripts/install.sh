#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs polyturn with everything it needs. Idempotent: when the
# installed set already matches pyproject.toml (hash stamp), it returns in a second or two.
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

check_gpu_path() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    .venv/bin/python -m cpu_standins check-install
  fi
}

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"polyturn needs Python 3.11, found {sys.version}"'

[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.polyturn-install-stamp
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "polyturn: .venv is up to date"
  check_gpu_path
  exit 0
fi

start=$(date +%s)
. .venv/bin/activate
pip install -q --upgrade pip
# torch first, pinned to the build sglang 0.5.23 expects (taken from local disk where it lies there).
pip install -q torch==2.14.1 torchvision==0.29.1 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
pip install -q -e .
pip check || echo "polyturn: pip check reported the conflicts above" >&2
echo "$want" > "$stamp"
echo "polyturn: installed in $(( $(date +%s) - start )) s"
check_gpu_path
