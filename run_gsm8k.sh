#!/usr/bin/env bash
# GRPO on GSM8K with tools; without a GPU, the CPU preset that learns (synthetic GSM8K-format problems).
#
#   bash run_gsm8k.sh [hydra overrides...]
#
# 1. installs .venv (scripts/install.sh; returns at once when up to date);
# 2. with a GPU (or PRESET set): prepares GSM8K as verl-format parquet in $DATA_DIR (default ./data/gsm8k,
#    git-ignored) from the hub (openai/gsm8k), or from LOCAL_GSM8K (a directory holding GSM8K's train.jsonl and
#    test.jsonl) when set, and trains the gsm8k_qwen2_5_3b preset (PRESET=cpu_tiny: the tiny test model, a few steps on CPU);
# 3. without a GPU: the cpu_learn preset in $RUN_DIR (default ./outputs/cpu_learn/seed$SEED):
#    synthetic GSM8K-format data (recipe.tasks.synthetic_math) -> tiny Qwen2 (init std 0.02) ->
#    multi-turn SFT (recipe.main_sft) -> GRPO with the python tool (recipe.main_ppo --config-name
#    cpu_learn, validated before the first step and every few steps) -> one JSON line
#    {"val_acc_sft", "val_acc_rl", "tool_call_rate_sft", "tool_call_rate_rl", "steps", "wall_s"}
#    and $RUN_DIR/val_acc.svg. SEED seeds the data, the model, SFT and RL. SCHEDULE (sync, one_step_off or
#    fully_async; default sync) is the RL schedule (async_training.schedule); the two async ones give the engine
#    a CPU bundle of its own (actor_rollout_ref.hybrid_engine=false rollout.nnodes=1 rollout.n_gpus_per_node=1).
# Extra arguments are Hydra overrides of the (RL) trainer, e.g.
#    bash run_gsm8k.sh trainer.total_training_steps=5 actor_rollout_ref.model.path=/models/Qwen2.5-3B-Instruct
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)

bash scripts/install.sh
. .venv/bin/activate

if [ -n "${PRESET:-}" ] || python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  DATA_DIR=${DATA_DIR:-$ROOT/data/gsm8k}
  LOCAL_GSM8K=${LOCAL_GSM8K:-}  # opt-in: a directory with GSM8K's train.jsonl / test.jsonl; unset: the hub
  if [ ! -f "$DATA_DIR/train.parquet" ]; then
    if [ -n "$LOCAL_GSM8K" ]; then
      if [ ! -f "$LOCAL_GSM8K/train.jsonl" ] || [ ! -f "$LOCAL_GSM8K/test.jsonl" ]; then
        echo "run_gsm8k: LOCAL_GSM8K=$LOCAL_GSM8K holds no train.jsonl / test.jsonl; point it at GSM8K's jsonl files or unset it (the hub)" >&2
        exit 2
      fi
      python -m recipe.tasks.gsm8k --out "$DATA_DIR" --local-dir "$LOCAL_GSM8K"
    else
      python -m recipe.tasks.gsm8k --out "$DATA_DIR"
    fi
  fi
  PRESET=${PRESET:-gsm8k_qwen2_5_3b}
  DATA_ARGS=("data.train_files=[$DATA_DIR/train.parquet]")
  if [ "$PRESET" = cpu_tiny ]; then
    export WANDB_MODE=${WANDB_MODE:-offline}  # no login on CPU dev machines; `wandb sync` the run later
  else
    DATA_ARGS+=("data.val_files=[$DATA_DIR/test.parquet]")  # cpu_tiny does not validate
  fi
  echo "run_gsm8k: preset $PRESET, data $DATA_DIR"
  exec python -m recipe.main_ppo --config-name "$PRESET" "${DATA_ARGS[@]}" "$@"
fi

# ---- no GPU: the cpu_learn preset --------------------------------------------------------------
export WANDB_MODE=${WANDB_MODE:-offline}
SEED=${SEED:-0}
SCHEDULE=${SCHEDULE:-sync}
SCHEDULE_ARGS=("async_training.schedule=$SCHEDULE")
if [ "$SCHEDULE" != sync ]; then
  SCHEDULE_ARGS+=(actor_rollout_ref.hybrid_engine=false rollout.nnodes=1 rollout.n_gpus_per_node=1)
fi
RUN_DIR=${RUN_DIR:-$ROOT/outputs/cpu_learn/seed$SEED}
SFT_STEPS=${SFT_STEPS:-800}          # optimizer steps of 16 demonstrations
N_TEST=${N_TEST:-256}                # held-out problems
START=$(date +%s)
echo "run_gsm8k: cpu_learn preset, seed $SEED, schedule $SCHEDULE, run dir $RUN_DIR"
rm -rf "$RUN_DIR/data" "$RUN_DIR/base_model" "$RUN_DIR/sft" "$RUN_DIR/rl"  # this preset's own outputs only

python -m recipe.tasks.synthetic_math --out "$RUN_DIR/data" --seed "$SEED" --test "$N_TEST" \
  --tool-config tool_configs/python_calc_tool_config.yaml
python -m recipe.tiny_model --out "$RUN_DIR/base_model" --seed "$SEED" --layers 2 --hidden 128 --heads 4 \
  --kv-heads 2 --intermediate 512 --init-std 0.02 --compact-tools
python -m recipe.main_sft "data.train_files=[$RUN_DIR/data/sft.parquet]" "model.partial_pretrain=$RUN_DIR/base_model" \
  "trainer.default_local_dir=$RUN_DIR/sft" "trainer.total_training_steps=$SFT_STEPS" data.train_batch_size=16 \
  data.micro_batch_size_per_gpu=16 data.max_length=256 optim.lr=1e-3 optim.min_lr=5e-5 "optim.lr_warmup_steps=$(( SFT_STEPS / 40 ))" \
  optim.lr_decay_style=cosine "optim.lr_decay_steps=$SFT_STEPS" optim.weight_decay=0.0 megatron.dtype=float32 ray_init.num_cpus=2 "seed=$SEED"
python -m recipe.main_ppo --config-name cpu_learn "data.train_files=[$RUN_DIR/data/train.parquet]" \
  "data.val_files=[$RUN_DIR/data/test.parquet]" "actor_rollout_ref.model.path=$RUN_DIR/sft/hf" \
  "trainer.default_local_dir=$RUN_DIR/rl" "trainer.validation_data_dir=$RUN_DIR/rl/validation" \
  "trainer.seed=$SEED" "${SCHEDULE_ARGS[@]}" "$@"
python -m recipe.cpu_preset --val-dir "$RUN_DIR/rl/validation" --out "$RUN_DIR" --wall-s "$(( $(date +%s) - START ))"
