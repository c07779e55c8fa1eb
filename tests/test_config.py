"""The trainer config: Hydra presets compose, bad values fail at start naming the key and the fix,
and the public key surface is frozen (torchtitan's `test_no_new_cli_options` idea)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.config_build import flat_keys
from recipe.config_schema import ConfigError, PPOConfig

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "recipe" / "config")
PRESETS = ("ppo_trainer", "cpu_tiny", "cpu_learn", "gsm8k_qwen2_5_3b", "fully_async_ppo_megatron_trainer")

# The public config surface. A change here is a change for every user's scripts: add keys on
# purpose (with a docstring in recipe/config_schema.py), never by accident.
FROZEN_KEYS = """
actor_rollout_ref.actor.clip_ratio_c actor_rollout_ref.actor.clip_ratio_high actor_rollout_ref.actor.clip_ratio_low
actor_rollout_ref.actor.entropy_coeff actor_rollout_ref.actor.kl_loss_coef actor_rollout_ref.actor.kl_loss_type
actor_rollout_ref.actor.loss_agg_mode actor_rollout_ref.actor.loss_scale_factor
actor_rollout_ref.actor.policy_loss.loss_mode actor_rollout_ref.actor.policy_loss.clip_cov_ratio
actor_rollout_ref.actor.policy_loss.clip_cov_lb actor_rollout_ref.actor.policy_loss.clip_cov_ub
actor_rollout_ref.actor.policy_loss.kl_cov_ratio actor_rollout_ref.actor.policy_loss.ppo_kl_coef
actor_rollout_ref.actor.megatron.pipeline_model_parallel_size actor_rollout_ref.actor.megatron.param_offload
actor_rollout_ref.actor.megatron.grad_offload actor_rollout_ref.actor.megatron.optimizer_offload actor_rollout_ref.hybrid_engine
actor_rollout_ref.rollout.update_weights_mode actor_rollout_ref.rollout.check_weights
actor_rollout_ref.rollout.deterministic rollout.nnodes rollout.n_gpus_per_node
actor_rollout_ref.actor.megatron.tensor_model_parallel_size
actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size
actor_rollout_ref.actor.optim.adam_beta1 actor_rollout_ref.actor.optim.adam_beta2 actor_rollout_ref.actor.optim.adam_eps
actor_rollout_ref.actor.optim.clip_grad actor_rollout_ref.actor.optim.lr actor_rollout_ref.actor.optim.lr_decay_steps
actor_rollout_ref.actor.optim.lr_decay_style actor_rollout_ref.actor.optim.lr_warmup_init
actor_rollout_ref.actor.optim.lr_warmup_steps actor_rollout_ref.actor.optim.min_lr
actor_rollout_ref.actor.optim.use_distributed_optimizer actor_rollout_ref.actor.optim.weight_decay
actor_rollout_ref.actor.ppo_epochs actor_rollout_ref.actor.ppo_max_token_len_per_gpu actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
actor_rollout_ref.actor.ppo_mini_batch_size actor_rollout_ref.actor.use_dynamic_bsz actor_rollout_ref.actor.use_kl_loss
actor_rollout_ref.model.build_tiny actor_rollout_ref.model.path actor_rollout_ref.model.enable_gradient_checkpointing
actor_rollout_ref.model.trust_remote_code actor_rollout_ref.rollout.engine_kwargs.sglang data.apply_chat_template_kwargs
critic.model.enable_gradient_checkpointing
actor_rollout_ref.rollout.dtype actor_rollout_ref.rollout.gpu_memory_utilization actor_rollout_ref.rollout.max_model_len
actor_rollout_ref.rollout.max_total_tokens actor_rollout_ref.rollout.multi_turn.format
actor_rollout_ref.rollout.multi_turn.interaction_config_path actor_rollout_ref.rollout.multi_turn.max_assistant_turns
actor_rollout_ref.rollout.multi_turn.max_parallel_calls actor_rollout_ref.rollout.multi_turn.max_tool_response_length
actor_rollout_ref.rollout.multi_turn.max_user_turns actor_rollout_ref.rollout.multi_turn.tool_config_path
actor_rollout_ref.rollout.multi_turn.function_tool_path actor_rollout_ref.rollout.agent.default_agent_loop
actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side actor_rollout_ref.rollout.n actor_rollout_ref.rollout.name
actor_rollout_ref.rollout.response_length actor_rollout_ref.rollout.temperature actor_rollout_ref.rollout.tensor_model_parallel_size
actor_rollout_ref.rollout.top_k actor_rollout_ref.rollout.top_p actor_rollout_ref.rollout.update_weights_bucket_megabytes
actor_rollout_ref.rollout.multi_turn.enable actor_rollout_ref.rollout.val_kwargs.n actor_rollout_ref.rollout.val_kwargs.temperature
actor_rollout_ref.rollout.val_kwargs.top_p actor_rollout_ref.rollout.val_kwargs.top_k actor_rollout_ref.rollout.val_kwargs.do_sample
data.val_files trainer.total_epochs trainer.test_freq trainer.val_before_train trainer.log_val_generations
trainer.rollout_data_dir trainer.validation_data_dir
algorithm.adv_estimator algorithm.epsilon algorithm.gamma algorithm.kl_ctrl.horizon algorithm.kl_ctrl.kl_coef
algorithm.kl_ctrl.target_kl algorithm.kl_ctrl.type algorithm.kl_penalty algorithm.lam algorithm.norm_adv_by_std_in_grpo
algorithm.use_kl_in_reward algorithm.rollout_correction.rollout_is algorithm.rollout_correction.rollout_is_threshold
algorithm.rollout_correction.rollout_rs algorithm.rollout_correction.rollout_rs_threshold
algorithm.rollout_correction.rollout_rs_threshold_lower algorithm.rollout_correction.rollout_token_veto_threshold
algorithm.rollout_correction.rollout_is_batch_normalize
algorithm.filter_groups.enable algorithm.filter_groups.metric algorithm.filter_groups.max_num_gen_batches
critic.cliprange_value critic.loss_agg_mode critic.loss_scale_factor critic.optim.adam_beta1 critic.optim.adam_beta2
critic.optim.adam_eps critic.optim.clip_grad critic.optim.lr critic.optim.lr_decay_steps critic.optim.lr_decay_style
critic.optim.lr_warmup_init critic.optim.lr_warmup_steps critic.optim.min_lr critic.optim.use_distributed_optimizer
critic.optim.weight_decay critic.ppo_epochs
critic.ppo_micro_batch_size_per_gpu critic.ppo_mini_batch_size critic.ppo_max_token_len_per_gpu critic.use_dynamic_bsz
custom_reward_function.name custom_reward_function.path custom_reward_function.reward_kwargs
data.max_prompt_length data.max_response_length data.shuffle data.train_batch_size data.train_files
data.train_max_samples data.val_max_samples trainer.val_only
ray_init.num_cpus ray_init.temp_dir
reward.interaction_weight reward.outcome_weight reward.tool_final_weight reward.tool_weight
trainer.default_local_dir trainer.experiment_name trainer.logger trainer.n_gpus_per_node trainer.nnodes
trainer.project_name trainer.rollout_timeout_s trainer.seed trainer.total_training_steps
trainer.save_freq trainer.resume_mode trainer.resume_from_path trainer.max_actor_ckpt_to_keep
trainer.peak_tflops_per_gpu
actor_rollout_ref.actor.megatron.dtype actor_rollout_ref.actor.megatron.sequence_parallel
actor_rollout_ref.actor.megatron.override_transformer_config actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu
actor_rollout_ref.actor.log_prob_use_dynamic_bsz actor_rollout_ref.actor.log_prob_max_token_len_per_gpu
critic.megatron.tensor_model_parallel_size critic.megatron.pipeline_model_parallel_size
critic.megatron.virtual_pipeline_model_parallel_size critic.megatron.param_offload
critic.megatron.grad_offload critic.megatron.optimizer_offload critic.megatron.dtype critic.megatron.sequence_parallel
critic.megatron.override_transformer_config critic.log_prob_micro_batch_size_per_gpu critic.log_prob_use_dynamic_bsz
critic.log_prob_max_token_len_per_gpu
actor_rollout_ref.rollout.max_engine_restarts actor_rollout_ref.rollout.max_trajectory_retries
actor_rollout_ref.rollout.engine_health_timeout_s trainer.max_failed_fraction trainer.max_failed_steps
actor_rollout_ref.rollout.over_sample_rate
trainer.collective_timeout_s trainer.critic_warmup
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu actor_rollout_ref.ref.log_prob_use_dynamic_bsz
actor_rollout_ref.ref.log_prob_max_token_len_per_gpu
actor_rollout_ref.ref.megatron.tensor_model_parallel_size actor_rollout_ref.ref.megatron.pipeline_model_parallel_size
actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size
async_training.partial_rollout
async_training.schedule
async_training.stale_policy
async_training.staleness_bound
async_training.staleness_threshold
async_training.trigger_parameter_sync_step
""".split()


def yaml_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        if isinstance(v, dict) and v:  # an empty mapping is a leaf value (reward_kwargs: {})
            keys.extend(yaml_keys(v, f"{prefix}{k}."))
        else:
            keys.append(prefix + k)
    return keys


@pytest.fixture
def data_file(tmp_path) -> str:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"")  # validation only checks that the file exists
    return str(path)


def load(preset: str, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name=preset, overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def build(overrides: list[str], data_file: str, preset: str = "cpu_tiny") -> PPOConfig:
    return PPOConfig.from_dict(load(preset, [f"data.train_files=[{data_file}]", *overrides]))


@pytest.mark.unit
def test_sum_norm_without_a_horizon_divides_by_the_padded_response_length(data_file):
    """Contract (verl v0.9's agg_loss): seq-mean-token-sum-norm with no loss_scale_factor divides by the padded
    response width, which verl's agent loop pads to rollout.response_length: the actor's and critic's horizon
    becomes that length (a given one stays)."""
    sum_norm = ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.adv_estimator=gae",
                "critic.loss_agg_mode=seq-mean-token-sum-norm", "data.max_response_length=48"]
    cfg = build(sum_norm, data_file)
    assert cfg.actor_rollout_ref.rollout.response_length == 48
    assert (cfg.actor_rollout_ref.actor.loss_scale_factor, cfg.critic.loss_scale_factor) == (48.0, 48.0)
    cfg = build([*sum_norm, "actor_rollout_ref.actor.loss_scale_factor=7"], data_file)
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == 7.0


@pytest.mark.unit
def test_config_surface_is_frozen():
    """Contract: the accepted keys (schema) are exactly the frozen list, and the composed base config (the
    dataclasses' defaults registered with Hydra, plus ppo_trainer.yaml) holds every one of them, and no other."""
    assert flat_keys(PPOConfig) == sorted(FROZEN_KEYS), "config keys changed: update FROZEN_KEYS on purpose"
    assert sorted(yaml_keys(load("ppo_trainer", []))) == sorted(FROZEN_KEYS)


@pytest.mark.unit
@pytest.mark.parametrize("preset", PRESETS)
def test_presets_compose_and_validate(preset, data_file, tmp_path):
    """Contract: every shipped preset composes with Hydra and validates (given data and, for the base, a model)."""
    base = ("ppo_trainer", "cpu_learn", "fully_async_ppo_megatron_trainer")
    model = [f"actor_rollout_ref.model.path={tmp_path}"] if preset in base else []
    data = [f"data.train_files=[{data_file}]", f"data.val_files=[{data_file}]"]
    cfg = PPOConfig.from_dict(load(preset, [*data, *model]))
    assert cfg.data.train_files == [str(Path(data_file).resolve())]
    if preset == "cpu_tiny":
        assert cfg.actor_rollout_ref.model.build_tiny and cfg.trainer.n_gpus_per_node == 1
        assert cfg.actor_rollout_ref.rollout.n == 2 and cfg.data.train_batch_size == 4
        assert cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path.endswith("gsm8k_tool_config.yaml")
    if preset == "fully_async_ppo_megatron_trainer":  # verl's fully-async config: a step is one mini-batch
        a = cfg.async_training
        assert (a.schedule, a.trigger_parameter_sync_step, a.staleness_threshold, a.partial_rollout) == (
            "fully_async", 4, 0.1, True)
        assert cfg.data.train_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        assert not cfg.actor_rollout_ref.hybrid_engine and cfg.rollout.n_gpus_per_node == 8
    if preset == "gsm8k_qwen2_5_3b":
        assert cfg.dp_size == 4 and cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-3B-Instruct"
        assert cfg.trainer.test_freq > 0 and cfg.trainer.save_freq > 0


@pytest.mark.unit
def test_parts_receive_their_own_typed_config(data_file):
    """Contract: each part gets its section as it is, typed as the part's own config class, from the verl-named keys."""
    from megatron_workers.config import ActorConfig, WorkerConfig
    from recipe.algos import PolicyLossConfig, ValueLossConfig
    from rollout.config import RolloutConfig

    cfg = build(["actor_rollout_ref.actor.clip_ratio_high=0.3", "actor_rollout_ref.rollout.n=4",
                 "data.max_response_length=64", "actor_rollout_ref.actor.optim.lr=2e-5",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], data_file)
    ar = cfg.actor_rollout_ref
    assert isinstance(ar.actor, ActorConfig) and isinstance(ar.actor, PolicyLossConfig)
    assert isinstance(cfg.critic, WorkerConfig) and isinstance(cfg.critic, ValueLossConfig)
    assert isinstance(ar.rollout, RolloutConfig)
    assert ar.actor.clip_ratio_high == 0.3 and ar.actor.ppo_micro_batch_size_per_gpu == 3 and ar.actor.optim.lr == 2e-5
    # rollout.response_length follows data.max_response_length (verl's interpolation) unless set on its own
    assert ar.rollout.n == 4 and ar.rollout.response_length == 64 and ar.rollout.multi_turn.max_assistant_turns == 2
    assert cfg.use_reference and not cfg.use_critic


@pytest.mark.unit
def test_config_schema_imports_neither_megatron_nor_sglang():
    """Contract: validating a config loads no heavy framework (the issue's must-show, in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import recipe.config_schema, sys; "
            "assert not {m.split('.')[0] for m in sys.modules} & {'megatron','sglang'}, 'heavy import'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(CONFIG_DIR).parents[1], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.unit
def test_importing_the_schemas_registers_nothing_with_hydra():
    """Contract: config_schema and sft_config hold declarations and checks only: importing them registers no Hydra
    node (a fresh interpreter); recipe.launch.compose registers the entry's schema before it composes."""
    import subprocess
    import sys

    code = ("import recipe.config_schema, recipe.sft_config; from hydra.core.config_store import ConfigStore; "
            "repo = ConfigStore.instance().repo; "
            "assert not {'ppo_trainer_schema.yaml', 'sft_trainer_schema.yaml'} & set(repo), sorted(repo)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(CONFIG_DIR).parents[1], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.unit
def test_estimator_needs_come_from_its_registry_entry(data_file, monkeypatch):
    """Contract: whether a run builds a critic, and whether fully_async is refused for a greedy rollout, is read from
    the estimator's registry entry (recipe.algos.registry), not its name: a new estimator declaring a critic gets one."""
    from recipe.algos.registry import ADV_ESTIMATORS, EstimatorSpec

    monkeypatch.setitem(ADV_ESTIMATORS, "my_critic_est", EstimatorSpec("recipe.algos.advantages.gae", needs_critic=True))
    monkeypatch.setitem(ADV_ESTIMATORS, "my_greedy_est",
                        EstimatorSpec("recipe.algos.advantages.remax", needs_greedy_rollout=True))
    cfg = build(["algorithm.adv_estimator=my_critic_est"], data_file)
    assert cfg.use_critic and "critic" in cfg.workers() and cfg.estimator.needs_critic
    assert not build(["algorithm.adv_estimator=grpo"], data_file).use_critic
    with pytest.raises(ConfigError, match=r"adv_estimator=my_greedy_est rolls out a greedy baseline"):
        build(["algorithm.adv_estimator=my_greedy_est", "async_training.schedule=fully_async",
               "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"], data_file)


@pytest.mark.unit
def test_every_config_field_has_a_docstring():
    """Contract: each field of every config section is declared once, with a string literal right under it."""
    import ast
    import dataclasses
    import inspect
    import typing

    from recipe.config_build import section_type
    from recipe.config_schema import PPOConfig

    seen, missing = set(), []

    def visit(cls: type) -> None:
        for klass in cls.__mro__:
            if not dataclasses.is_dataclass(klass) or klass in seen:
                continue
            seen.add(klass)
            body = ast.parse(inspect.getsource(klass)).body[0].body
            for i, node in enumerate(body):
                if isinstance(node, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                            and isinstance(nxt.value.value, str)):
                        missing.append(f"{klass.__name__}.{node.target.id}")
        for name, hint in typing.get_type_hints(cls).items():
            if section_type(hint) is not None:
                visit(section_type(hint))

    visit(PPOConfig)
    assert not missing, f"fields without a docstring: {missing}"


@pytest.mark.integration
def test_tool_call_formats_match_sglang():
    """Contract: the formats the light config accepts are exactly SGLang's FunctionCallParser formats."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    from rollout.config import TOOL_CALL_FORMATS

    assert sorted(TOOL_CALL_FORMATS) == sorted(FunctionCallParser.ToolCallParserEnum)


BAD = [
    (["trainer.test_freq=2"], r"data.val_files is empty"),
    (["trainer.test_freq=0"], r"trainer.test_freq is 0; use a step count >= 1, or -1"),
    (["actor_rollout_ref.rollout.val_kwargs.n=4"], r"val_kwargs.n is 4 with do_sample=false.*do_sample=true"),
    (["data.val_files=[nowhere.parquet]"], r"data.val_files='nowhere.parquet': no such file"),
    (["trainer.total_epochs=0", "trainer.total_training_steps=null"], r"trainer.total_epochs is 0; it must be >= 1"),
    (["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0"],
     r"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu is 0; it must be >= 1"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=3"], r"ppo_mini_batch_size=3 does not divide data.train_batch_size=4"),
    (["+actor_rollout_ref.actor.ppo_epoch=1"],
     r"unknown config key.*actor_rollout_ref\.actor\.ppo_epoch'\]; did you mean actor_rollout_ref\.actor\.ppo_epochs\?"),
    (["algorithm.adv_estimator=ppo"], r"algorithm.adv_estimator is 'ppo'; use one of"),
    (["actor_rollout_ref.actor.loss_scale_factor=0"], r"actor.loss_scale_factor is 0.0; give a horizon > 0"),
    (["trainer.logger=[console,mlflow]"], r"trainer.logger has \[.mlflow.\]"),
    (["actor_rollout_ref.model.build_tiny=false"], r"actor_rollout_ref.model.path is not set.*model.path="),
    (["actor_rollout_ref.model.path=/nowhere/model", "actor_rollout_ref.model.build_tiny=false"],
     r"actor_rollout_ref.model.path='/nowhere/model': no such file"),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
     r"n_gpus_per_node \* trainer.nnodes = 1 ranks is not a multiple of tensor x pipeline parallel size = 2"),
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=1"],
     r"ppo_mini_batch_size \* rollout.n = 1 samples cannot be split over 3 data-parallel ranks"),
    (["actor_rollout_ref.rollout.multi_turn.tool_config_path=missing.yaml"],
     r"multi_turn.tool_config_path='missing.yaml': no such file"),
    (["actor_rollout_ref.rollout.multi_turn.format=json"], r"multi_turn.format='json'"),
    (["actor_rollout_ref.rollout.n=0"], r"actor_rollout_ref.rollout.n is 0; it must be >= 1"),
    (["data.train_batch_size=four"], r"data.train_batch_size='four' has type str"),
    (["actor_rollout_ref.rollout.name=vllm"], r"rollout.name is 'vllm'; polyturn drives SGLang only"),
    (["critic.ppo_epochs=0", "algorithm.adv_estimator=gae"], r"^critic.ppo_epochs is 0; it must be >= 1"),
    (["actor_rollout_ref.actor.optim.lr_decay_style=cosin"], r"actor_rollout_ref.actor.optim.lr_decay_style is 'cosin'"),
    (["custom_reward_function.path=nowhere.py"], r"custom_reward_function.path='nowhere.py': no such file"),
    (["algorithm.kl_ctrl.type=pid"], r"algorithm.kl_ctrl.type is 'pid'"),
]


@pytest.mark.unit
@pytest.mark.parametrize("overrides,message", BAD, ids=[b[1][:40] for b in BAD])
def test_invalid_config_fails_at_start_naming_key_and_fix(overrides, message, data_file):
    """Contract: a wrong value is refused before anything starts, with the key and the fix in the message."""
    with pytest.raises(ConfigError, match=message):
        build(overrides, data_file)


@pytest.mark.unit
def test_missing_data_file_is_named(tmp_path):
    """Contract: a data file that does not exist is refused naming data.train_files."""
    with pytest.raises(ConfigError, match=r"data.train_files=.*nope.parquet.*no such file"):
        build([], str(tmp_path / "nope.parquet"))


VERL_LAUNCH = """
    algorithm.adv_estimator=grpo data.train_batch_size=4 data.max_prompt_length=512 data.max_response_length=48
    data.val_files=[{val}] trainer.test_freq=5 trainer.val_before_train=false trainer.total_epochs=15
    trainer.total_training_steps=null trainer.log_val_generations=3 trainer.rollout_data_dir={out}/rollout
    trainer.validation_data_dir={out}/val actor_rollout_ref.rollout.multi_turn.enable=true
    actor_rollout_ref.rollout.val_kwargs.n=3 actor_rollout_ref.rollout.val_kwargs.do_sample=true
    actor_rollout_ref.rollout.val_kwargs.temperature=0.6 actor_rollout_ref.rollout.val_kwargs.top_p=0.9
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 trainer.logger=[console,wandb]
"""


@pytest.mark.unit
def test_verl_launch_line_is_implemented(data_file, tmp_path):
    """Contract: a verl-style launch line with issue 9's keys composes with Hydra and builds typed values."""
    cfg = build(VERL_LAUNCH.format(val=data_file, out=tmp_path).split(), data_file)
    t, vk = cfg.trainer, cfg.actor_rollout_ref.rollout.val_kwargs
    assert cfg.data.val_files == [str(Path(data_file).resolve())]
    assert (t.test_freq, t.val_before_train, t.log_val_generations, t.total_epochs) == (5, False, 3, 15)
    assert t.rollout_data_dir == str(tmp_path / "rollout") and t.validation_data_dir == str(tmp_path / "val")
    assert (vk.n, vk.do_sample, vk.temperature, vk.top_p) == (3, True, 0.6, 0.9)
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable
    assert cfg.total_steps(batches_per_epoch=7) == 15 * 7  # epochs x batches when total_training_steps is null
    assert build(["trainer.total_training_steps=4"], data_file).total_steps(batches_per_epoch=7) == 4


def _leaves(node: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


@pytest.mark.unit
@pytest.mark.parametrize("preset", [*PRESETS, "sft_trainer"])
def test_every_preset_value_is_a_default_or_a_line_of_the_preset(preset):
    """Contract: defaults are declared once, in the dataclasses. Every value of a composed preset (unresolved) is
    the dataclass default or a line of the preset's own YAML (or of ppo_trainer.yaml, which the RL presets start
    from), and no line of a preset restates the value it would have without it; the SFT preset (sft_trainer, on
    SFTConfig, whose sections are the RL config's) likewise."""
    import yaml

    from recipe.config_build import defaults
    from recipe.sft_config import SFTConfig

    sft = preset == "sft_trainer"
    schema = _leaves(defaults(SFTConfig if sft else PPOConfig))
    base = {} if sft else _leaves({k: v for k, v in yaml.safe_load(Path(CONFIG_DIR, "ppo_trainer.yaml").read_text())
                                   .items() if k not in ("defaults", "hydra")})
    own = _leaves({k: v for k, v in yaml.safe_load(Path(CONFIG_DIR, f"{preset}.yaml").read_text()).items()
                   if k not in ("defaults", "hydra")})
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        composed = _leaves(OmegaConf.to_container(compose(config_name=preset), resolve=False))
    composed.pop("hydra", None)
    composed = {k: v for k, v in composed.items() if not k.startswith("hydra.")}
    assert set(composed) == set(schema), "a preset adds or lacks keys of the schema"
    for key, value in composed.items():
        source = own if key in own else base if key in base else schema
        assert value == source[key], f"{preset}: {key}={value!r} is neither the default nor a line of the preset"
    parent = schema if preset == "ppo_trainer" else {**schema, **base}
    restated = [k for k, v in own.items() if parent.get(k) == v]
    assert not restated, f"{preset}.yaml restates the value it inherits: {restated}"
