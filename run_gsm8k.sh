#!/usr/bin/env bash
# GRPO on GSM8K with the calc_gsm8k_reward tool and the gsm8k interaction.
#
#   bash run_gsm8k.sh [hydra overrides...]
#
# 1. installs .venv (scripts/install.sh; returns at once when up to date);
# 2. prepares GSM8K as verl-format parquet in $DATA_DIR (default ./data/gsm8k, git-ignored) from the
#    local copy in ../shared/data/gsm8k when it exists, else from the hub (openai/gsm8k);
# 3. trains: the gsm8k_qwen2_5_3b preset when a GPU is present, else cpu_tiny (the tiny test model,
#    a few steps on CPU). Extra arguments are Hydra overrides, e.g.
#    bash run_gsm8k.sh trainer.total_training_steps=5 actor_rollout_ref.model.path=/models/Qwen2.5-3B-Instruct
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)

bash scripts/install.sh
. .venv/bin/activate

DATA_DIR=${DATA_DIR:-$ROOT/data/gsm8k}
LOCAL_GSM8K=${LOCAL_GSM8K:-$ROOT/../shared/data/gsm8k}
if [ ! -f "$DATA_DIR/train.parquet" ]; then
  if [ -f "$LOCAL_GSM8K/train.jsonl" ]; then
    python -m recipe.data.gsm8k --out "$DATA_DIR" --local-dir "$LOCAL_GSM8K"
  else
    python -m recipe.data.gsm8k --out "$DATA_DIR"
  fi
fi

if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  PRESET=${PRESET:-gsm8k_qwen2_5_3b}
else
  PRESET=${PRESET:-cpu_tiny}
  export WANDB_MODE=${WANDB_MODE:-offline}  # no login on CPU dev machines; `wandb sync` the run later
fi
echo "run_gsm8k: preset $PRESET, data $DATA_DIR"
exec python -m recipe.main_ppo --config-name "$PRESET" "data.train_files=[$DATA_DIR/train.parquet]" "$@"
