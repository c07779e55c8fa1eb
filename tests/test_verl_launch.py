"""A verl launch line, as a verl user runs it, through polyturn's config: every key is taken with verl's meaning,
or refused by name with what to do instead, before anything starts.

The line is verl's `examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh` (GRPO, Qwen2.5-3B, SGLang
multi-turn with the gsm8k tool, 8 GPUs), with local paths, plus the issue-9 keys it leaves at their defaults
(checkpointing, resume, validation). It is composed by Hydra on the base config (`ppo_trainer`, as verl's own
`--config-name` would be) and built into the typed config; no Ray, no engine, no training.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.config_schema import ConfigError, PPOConfig, refuse_unsupported_overrides

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(REPO / "recipe" / "config")

# key=value as in verl's script (paths filled in by `launch_line`); the comment-free lines are all overrides
VERL_LINE = """
algorithm.adv_estimator=grpo
data.train_batch_size=256
data.max_prompt_length=1024
data.max_response_length=1024
data.filter_overlong_prompts=True
data.truncation='error'
data.return_raw_chat=True
actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=sglang
actor_rollout_ref.rollout.gpu_memory_utilization=0.5
actor_rollout_ref.rollout.n=16
actor_rollout_ref.rollout.multi_turn.enable=True
actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False
trainer.critic_warmup=0
trainer.logger=['console','wandb']
trainer.project_name='gsm8k_async_rl'
trainer.experiment_name='qwen2.5-3b_function_rm-gsm8k-async-sgl-multi-w-tool-verify-n16'
trainer.n_gpus_per_node=8
trainer.nnodes=1
trainer.save_freq=20
trainer.test_freq=20
trainer.val_before_train=False
trainer.log_val_generations=10
trainer.resume_mode=auto
trainer.max_actor_ckpt_to_keep=3
trainer.default_local_dir={out}
data.train_files={data}/train.parquet
data.val_files={data}/test.parquet
actor_rollout_ref.rollout.multi_turn.tool_config_path={repo}/tool_configs/gsm8k_tool_config.yaml
trainer.total_epochs=15
"""

# The verl keys of that line polyturn refuses, each with the words of its advice that say what to do instead.
REFUSED = {
    "data.filter_overlong_prompts": "always dropped at load",
    "data.truncation": "never truncated",
    "data.return_raw_chat": "renders the raw chat messages itself",
    "actor_rollout_ref.model.use_remove_padding": "pack sequences their own way",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "not wired to Megatron's recompute",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "use actor_rollout_ref.actor.megatron.*",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "use actor_rollout_ref.actor.megatron.*",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "the reference uses actor_rollout_ref.actor.ppo_micro",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "without an optimizer",
    "trainer.critic_warmup": "update every step",
}


def launch_line(tmp_path: Path) -> list[str]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for split in ("train", "test"):
        (data / f"{split}.parquet").write_bytes(b"")  # the config checks that the files exist
    text = VERL_LINE.format(out=tmp_path / "out", data=data, repo=REPO)
    return [line for line in text.split() if line]


def _key(arg: str) -> str:
    return arg.split("=", 1)[0]


def _typed_value(cfg: PPOConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _expected(arg: str):
    """The value an override sets, as Hydra's override grammar parses it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (override,) = OverridesParser.create().parse_overrides([arg])
    return override.value()


@pytest.mark.unit
def test_every_key_of_a_verl_launch_line_is_mapped_or_refused_by_name(tmp_path):
    """Contract: the refused verl keys are all named at once, each as "not supported by polyturn: <key>; <what to do
    instead>", before Hydra composes; every other key of the line composes, validates, and lands in the typed config
    with the value the line gave it (paths resolved), with verl's meaning: total_epochs counts passes over the data
    (verl's default total_training_steps is null), rollout.n samples per prompt, tensor parallelism of the engines."""
    line = launch_line(tmp_path)
    assert {_key(a) for a in line} >= set(REFUSED)
    with pytest.raises(ConfigError) as refused:
        refuse_unsupported_overrides(line)
    lines = str(refused.value).splitlines()
    assert [ln.split(";")[0] for ln in lines] == [f"not supported by polyturn: {_key(a)}" for a in line
                                                  if _key(a) in REFUSED]
    for ln in lines:
        key = ln.split(";")[0].removeprefix("not supported by polyturn: ")
        assert REFUSED[key] in ln, ln

    accepted = [a for a in line if _key(a) not in REFUSED]
    refuse_unsupported_overrides(accepted)  # nothing left to refuse
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = PPOConfig.from_dict(OmegaConf.to_container(compose(config_name="ppo_trainer", overrides=accepted),
                                                         resolve=True))
    for arg in accepted:
        key, want = _key(arg), _expected(arg)
        got = _typed_value(cfg, key)
        if key.endswith(("_files", "_path", "default_local_dir")):
            want = [str(Path(want).resolve())] if key.endswith("_files") else str(Path(want).resolve())
        assert got == want, f"{key}: the line set {want!r}, the config holds {got!r}"
    assert cfg.trainer.total_training_steps is None and cfg.total_steps(batches_per_epoch=29) == 15 * 29
    assert cfg.use_reference and not cfg.use_critic and cfg.dp_size == 8


@pytest.mark.unit
def test_the_launch_command_refuses_before_anything_starts(tmp_path):
    """Contract: `python -m recipe.main_ppo <verl line>` exits non-zero naming every refused key and what to do
    instead, before Hydra, Ray, Megatron or SGLang start (no output directory is created)."""
    line = launch_line(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "recipe.main_ppo", *line], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    for key in REFUSED:
        assert f"not supported by polyturn: {key}; " in proc.stderr, key
    assert not (tmp_path / "out").exists()
