"""verl's launch lines, as verl's scripts write them, through polyturn's entry point: every key is honoured, or
listed in ONE start-up warning as having no effect here, or refused before Ray, all at once, naming the key and
the fix (a v0.9 launch that trains a step on the tiny model: tests/test_verl_v0_9_run.py).

The lines are verl's own (github.com/volcengine/verl, examples/sglang_multiturn/
run_qwen2.5-3b_gsm8k_multiturn.sh and run_qwen2.5-3b_megatron_gsm8k_multiturn.sh), copied as the shell passes
them (quotes removed), without `--config-path/--config-name` (tests/test_launch_mistakes.py covers those).
"""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from megatron_workers.config import FULL_RECOMPUTE
from recipe import launch
from recipe.config_schema import ConfigError
from recipe.tasks import gsm8k

REPO = Path(__file__).resolve().parents[1]

# verl's run_qwen2.5-3b_gsm8k_multiturn.sh, its overrides as written ($HOME, $PROJECT_DIR, $EXPERIMENT_NAME as in
# the script; filled in by `line`).
VERL_3B = """
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
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    global_profiler.tool=torch_memory
    global_profiler.save_path=./mem_snapshots
    global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000
    global_profiler.global_tool_config.torch_memory.stack_depth=32
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.name=sglang
    actor_rollout_ref.rollout.gpu_memory_utilization=0.85
    actor_rollout_ref.rollout.multi_stage_wake_up=True
    actor_rollout_ref.rollout.n=16
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    actor_rollout_ref.rollout.over_sample_rate=0.1
    actor_rollout_ref.rollout.mode=async
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console","wandb"]'
    trainer.project_name='multi-turn-grpo-qwen2.5-3b-sglang'
    trainer.experiment_name=$EXPERIMENT_NAME
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=20
    trainer.val_before_train=True
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$PROJECT_DIR/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml"
    trainer.total_epochs=15
"""

# The keys run_qwen2.5-3b_megatron_gsm8k_multiturn.sh adds to (or sets differently from) the line above.
VERL_MEGATRON = """
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
    actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2
    actor_rollout_ref.actor.megatron.context_parallel_size=2
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.actor.megatron.seed=42
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
    actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=2
    actor_rollout_ref.ref.megatron.context_parallel_size=2
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
"""

# verl v0.9's fully async Megatron line (verl/experimental/fully_async_policy/shell/
# grpo_8b_base_math_megatron_4_4_trtllm.sh: `python -m verl.experimental.fully_async_policy.fully_async_main
# --config-path=config --config-name='fully_async_ppo_megatron_trainer.yaml' ...`), its overrides as written, the
# `fully_async` block last. Left out: what polyturn refuses for other reasons than the schedule (data.truncation=left,
# megatron.use_mbridge, rollout.max_num_batched_tokens / max_num_seqs / disable_log_stats, *.trust_remote_code,
# reward.reward_manager.name), and rollout.name=trtllm is sglang here.
VERL_FULLY_ASYNC = """
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    data.return_raw_chat=True
    data.prompt_key=prompt
    data.max_prompt_length=2048
    data.max_response_length=8192
    actor_rollout_ref.rollout.n=16
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.clip_ratio_c=10.0
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps=10
    actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.megatron.param_offload=False
    actor_rollout_ref.actor.megatron.optimizer_offload=False
    actor_rollout_ref.actor.megatron.grad_offload=False
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.actor.megatron.context_parallel_size=1
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.optim.clip_grad=1.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    actor_rollout_ref.rollout.val_kwargs.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.n=4
    actor_rollout_ref.rollout.name=sglang
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.ref.megatron.context_parallel_size=1
    actor_rollout_ref.ref.megatron.param_offload=False
    trainer.logger=['console','wandb']
    trainer.project_name=DAPO-Qwen3-8b-Base-MATH-fully-async
    trainer.experiment_name=$EXPERIMENT_NAME
    trainer.val_before_train=True
    trainer.save_freq=-1
    trainer.resume_mode=auto
    trainer.log_val_generations=10
    trainer.total_epochs=10
    algorithm.rollout_correction.bypass_mode=False
    algorithm.rollout_correction.rollout_is=token
    data.train_batch_size=0
    data.gen_batch_size=1
    trainer.test_freq=10
    actor_rollout_ref.hybrid_engine=False
    actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.actor.optim.lr_decay_steps=51200
    rollout.total_rollout_steps=51200
    trainer.nnodes=1
    trainer.n_gpus_per_node=4
    rollout.nnodes=1
    rollout.n_gpus_per_node=4
    async_training.staleness_threshold=0.5
    async_training.trigger_parameter_sync_step=4
    async_training.require_batches=1
    async_training.partial_rollout=True
"""

# What the 3B line's verl-only keys become (the line's other keys are polyturn keys of the same name).
WARNED = ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
          "global_profiler.tool", "global_profiler.save_path",
          "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries",
          "global_profiler.global_tool_config.torch_memory.stack_depth", "actor_rollout_ref.rollout.multi_stage_wake_up",
          "actor_rollout_ref.ref.fsdp_config.param_offload")
RECORDS = [{"question": f"Tom has {i} boxes of 3 apples. How many apples?", "answer": f"{i} * 3 = {3 * i}\n#### {3 * i}"}
           for i in range(2, 6)]


def line(text: str, home: Path, model: str = "Qwen/Qwen2.5-3B-Instruct", **values: object) -> list[str]:
    """A verl line as the shell passes it, with its paths under `home` and the polyturn checkout, the model path
    `model`, and any `key=value` replaced in place by `values` (key -> new value)."""
    text = (text.replace("$HOME", str(home)).replace("$PROJECT_DIR/examples/sglang_multiturn/config/tool_config", str(REPO / "tool_configs"))
            .replace("$EXPERIMENT_NAME", "qwen2.5-3b_baseline").replace("Qwen/Qwen2.5-3B-Instruct", model))
    args = shlex.split(text)
    out = []
    for arg in args:
        key = arg.split("=", 1)[0]
        out.append(f"{key}={values.pop(key)}" if key in values else arg)
    assert not values, f"not keys of the line: {sorted(values)}"
    return out


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """$HOME with verl's data layout: data/gsm8k/{train,test}.parquet (4 rows each)."""
    home = tmp_path_factory.mktemp("home")
    for split in ("train", "test"):
        gsm8k.write_rows([gsm8k.make_row(r, split, i) for i, r in enumerate(RECORDS)],
                         home / "data" / "gsm8k" / f"{split}.parquet")
    return home


@pytest.mark.unit
def test_verl_3b_line_is_honoured_with_one_warning(home, tiny_model_dir):
    """Contract: every key of verl's 3B multi-turn line is taken: its polyturn keys with the line's values, verl's
    renamed keys onto their counterparts (rollout.log_prob_* sizes the actor's old-log-prob pass, ref.log_prob_* the
    reference's, logger as a list), the values polyturn
    always has (filter_overlong_prompts, truncation=error, return_raw_chat, use_remove_padding, critic_warmup=0)
    (and rollout.mode=async) silently, gradient checkpointing as Megatron's full activation recompute, and the knobs
    with no effect on the result here in ONE warning that lists each."""
    cfg, config, plan = launch.load(line(VERL_3B, home, str(tiny_model_dir)))
    ar = cfg.actor_rollout_ref
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (256, 1024, 1024)
    assert ar.model.path == str(tiny_model_dir) and ar.actor.optim.lr == 1e-6 and ar.actor.use_kl_loss
    assert (ar.actor.ppo_mini_batch_size, ar.actor.ppo_micro_batch_size_per_gpu, ar.actor.kl_loss_coef) == (256, 32, 0.001)
    assert ar.actor.log_prob_micro_batch_size_per_gpu == 32 and ar.ref.log_prob_micro_batch_size_per_gpu == 32
    assert ar.ref.reference(ar.actor).optim is None
    assert ar.actor.megatron.override_transformer_config == FULL_RECOMPUTE  # enable_gradient_checkpointing
    assert (ar.rollout.n, ar.rollout.gpu_memory_utilization, ar.rollout.tensor_model_parallel_size) == (16, 0.85, 1)
    assert ar.rollout.over_sample_rate == 0.1
    assert ar.rollout.multi_turn.tool_config_path == str(REPO / "tool_configs" / "gsm8k_tool_config.yaml")
    t = cfg.trainer
    assert t.logger == ["console", "wandb"] and t.project_name == "multi-turn-grpo-qwen2.5-3b-sglang"
    assert (t.n_gpus_per_node, t.save_freq, t.test_freq, t.val_before_train, t.total_epochs) == (8, -1, 20, True, 15)
    assert t.total_training_steps is None and cfg.total_steps(batches_per_epoch=29) == 15 * 29  # verl's epochs
    assert cfg.data.val_files == [str(home / "data" / "gsm8k" / "test.parquet")]
    warning = plan.warning()
    assert warning is not None and "\n" not in warning
    assert [w.split("=")[0].split(" ")[0] for w in plan.warned] == list(WARNED)


@pytest.mark.unit
def test_verl_megatron_line_is_refused_all_at_once(home, tiny_model_dir):
    """Contract: verl's Megatron variant asks for context parallelism (actor and reference): refused before Ray in
    one run, a line for each key naming it and the fix; virtual pipeline stages (vpp) are taken (the reference inherits the
    actor's); megatron.seed becomes
    trainer.seed; the reference's TP / PP sizes are its own layout (also unlike the actor's), while its other
    Megatron keys (dtype, offload) must equal the actor's."""
    args = line(VERL_3B, home, str(tiny_model_dir)) + shlex.split(VERL_MEGATRON)
    with pytest.raises(ConfigError) as refused:
        launch.load(args)
    lines = refused.value.problems
    assert len(lines) == 2 and all("context parallelism is not supported" in line for line in lines)
    assert lines[0].startswith("actor_rollout_ref.actor.megatron.context_parallel_size=2: ")
    assert lines[1].startswith("actor_rollout_ref.ref.megatron.context_parallel_size=2: ")
    fine = [a for a in args if "context_parallel_size" not in a]
    cfg, _, plan = launch.load(fine)
    m = cfg.actor_rollout_ref.actor.megatron
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.vpp, cfg.trainer.seed) == (2, 2, 2, 42)
    assert not any("virtual_pipeline" in w for w in plan.warned)
    own = launch.load([a for a in fine if "actor.megatron.tensor_model_parallel_size" not in a])[0]
    ref = own.workers()["ref"]
    assert (ref.megatron.tensor_model_parallel_size, ref.megatron.pipeline_model_parallel_size, ref.megatron.vpp) == (2, 2, 2)
    assert own.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1 and own.role_dp_size(ref) == 2
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.ref.megatron.dtype=float32: the KL term .*must equal"):
        launch.load([*fine, "actor_rollout_ref.ref.megatron.dtype=float32"])


@pytest.mark.unit
@pytest.mark.parametrize("config_name", ["fully_async_ppo_megatron_trainer.yaml", "fully_async_ppo_trainer"])
def test_verl_fully_async_line_composes_to_fully_async(home, tiny_model_dir, config_name):
    """Contract: verl v0.9's fully async line, with its --config-name (polyturn's preset of that name; verl's FSDP
    name runs as it), composes before Ray to async_training.schedule=fully_async with verl's meanings:
    staleness_threshold, trigger_parameter_sync_step and partial_rollout as given; a step trains on require_batches x
    ppo_mini_batch_size prompt groups (verl's data.train_batch_size=0), and rollout.total_rollout_steps prompts make
    total_rollout_steps // that steps; the engines on their own pool. Nothing of it is warned about, but verl's
    config's default bypass_mode=True when the line leaves it out (the trainer recomputes old log-probs here)."""
    import ray

    args = ["--config-name", config_name, *line(VERL_FULLY_ASYNC, home, str(tiny_model_dir))]
    cfg, _, plan = launch.load(args)
    a = cfg.async_training
    assert (a.schedule, a.staleness_threshold, a.trigger_parameter_sync_step, a.partial_rollout) == (
        "fully_async", 0.5, 4, True)
    assert cfg.data.train_batch_size == 1 * 32 and cfg.trainer.total_training_steps == 51200 // 32
    assert not cfg.actor_rollout_ref.hybrid_engine and (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) == (1, 4)
    assert cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 4096 and cfg.actor_rollout_ref.rollout.n == 16
    assert "data.train_batch_size=32" in plan.overrides and plan.warning() is None
    assert not ray.is_initialized()
    default = launch.load([a for a in args if "bypass_mode" not in a])[2].warning()  # verl's config defaults it True
    assert "algorithm.rollout_correction.bypass_mode (verl's fully-async config defaults it to True" in default
    two = launch.load(line(VERL_FULLY_ASYNC, home, str(tiny_model_dir), **{"async_training.require_batches": 2})
                      + ["async_training.schedule=fully_async"])[0]  # the base config, the schedule set
    assert two.data.train_batch_size == 64 and two.trainer.total_training_steps == 800


@pytest.mark.unit
def test_verl_fully_async_line_without_its_config_name_is_refused(home, tiny_model_dir):
    """Contract: verl's fully-async keys under the sync schedule (the line without verl's fully-async config name,
    or a staleness_threshold alone) are refused before Ray, a line naming them and the fix for the batch keys and one
    for the async knobs, in the same run, never run synchronously in silence."""
    with pytest.raises(ConfigError) as refused:
        launch.load(line(VERL_FULLY_ASYNC, home, str(tiny_model_dir)))
    message, knobs = refused.value.problems
    assert "data.train_batch_size=0" in message and "rollout.total_rollout_steps=51200" in message
    assert knobs.startswith("async_training.staleness_threshold=0.5, async_training.trigger_parameter_sync_step=4: ")
    assert "set async_training.schedule=fully_async (verl's fully_async_main: --config-name " \
           "fully_async_ppo_megatron_trainer)" in message
    base = ["--config-name", "cpu_tiny", f"data.train_files=[{home / 'data' / 'gsm8k' / 'train.parquet'}]"]
    for key in ("async_training.staleness_threshold=0.5", "async_training.trigger_parameter_sync_step=4",
                "async_training.partial_rollout=False"):
        with pytest.raises(ConfigError, match=rf"^{key}: only async_training.schedule=fully_async reads it, and sync "
                                              r"would ignore it; set async_training.schedule=fully_async"):
            launch.load([*base, key])
    with pytest.raises(ConfigError, match=r"one_step_off would ignore it"):
        launch.load([*base, "async_training.staleness_threshold=0.5", "async_training.schedule=one_step_off",
                     "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"])
    with pytest.raises(ConfigError, match=r"^async_training.require_batches sets data.train_batch_size here"):
        launch.load([*base, "async_training.schedule=fully_async", "actor_rollout_ref.hybrid_engine=false",
                     "rollout.nnodes=1", "rollout.n_gpus_per_node=1", "async_training.require_batches=2",
                     "data.train_batch_size=4"])


@pytest.mark.unit
def test_gradient_checkpointing_is_megatron_full_recompute(home):
    """Contract: verl's model.enable_gradient_checkpointing=True (actor and critic) becomes Megatron's full activation
    recompute (uniform, one layer per checkpoint) in that role's override_transformer_config; recompute_* fields
    given there win (granularity full alone gets the method and layer count; selective stays selective)."""
    base = ["--config-name", "cpu_tiny", f"data.train_files=[{home / 'data' / 'gsm8k' / 'train.parquet'}]"]
    on = "actor_rollout_ref.model.enable_gradient_checkpointing=True"
    override = "actor_rollout_ref.actor.megatron.override_transformer_config."

    def recompute(*args: str) -> tuple[dict, dict]:
        cfg = launch.load([*base, *args])[0]
        return cfg.actor_rollout_ref.actor.megatron.override_transformer_config, cfg.critic.megatron.override_transformer_config

    assert recompute() == ({}, {})
    assert recompute(on, "critic.model.enable_gradient_checkpointing=True") == (FULL_RECOMPUTE, FULL_RECOMPUTE)
    assert recompute(on, f"{override}recompute_method=block", f"{override}recompute_num_layers=2")[0] == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}
    assert recompute(on, f"{override}recompute_granularity=selective")[0] == {"recompute_granularity": "selective"}
    assert recompute(f"{override}recompute_granularity=full") == (FULL_RECOMPUTE, {})


@pytest.mark.unit
def test_verl_v0_9_loss_keys_are_taken_and_unbuilt_modes_refused(home, tiny_model_dir):
    """Contract: verl v0.9's `actor.policy_loss.loss_mode` (gspo, with its clip range) and `kl_loss_type=k3+` on the 3B
    line compose and reach the policy loss's config; a verl loss mode polyturn does not build is refused before
    Ray in ONE line naming the key, saying it is not built and why."""
    args = line(VERL_3B, home, str(tiny_model_dir), **{"actor_rollout_ref.actor.kl_loss_type": "k3+"})
    cfg = launch.load([*args, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                       "actor_rollout_ref.actor.clip_ratio_low=0.0003", "actor_rollout_ref.actor.clip_ratio_high=0.0004",
                       "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.001"])[0]
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == "gspo" and actor.kl_loss_type == "k3+"
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.policy_loss.kl_cov_ratio) == (0.0003, 0.0004, 0.001)
    assert cfg.actor_rollout_ref.ref.reference(actor).policy_loss.loss_mode == "gspo"
    with pytest.raises(ConfigError) as refused:
        launch.load([*args, "actor_rollout_ref.actor.policy_loss.loss_mode=sapo"])
    (said,) = refused.value.problems
    assert said.startswith("actor_rollout_ref.actor.policy_loss.loss_mode=sapo is not built in polyturn: ")
    assert "use one of" in said and "\n" not in str(refused.value)


@pytest.mark.unit
def test_verl_v0_9_rollout_correction_and_reward_section_are_taken(home, tiny_model_dir, tmp_path):
    """Contract: verl v0.9's rollout-correction forms (rejection options, "lower_upper" thresholds, batch
    normalisation) reach algorithm.rollout_correction; v0.9's `reward.custom_reward_function.*` (reward_kwargs too,
    key by key) is the same config as the old top-level section, the two given together are refused as one key given
    twice, and a model reward stays refused."""
    scorer = tmp_path / "score.py"
    scorer.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 0.0\n")
    args = line(VERL_3B, home, str(tiny_model_dir))
    rc = "algorithm.rollout_correction"
    cfg = launch.load([*args, f"{rc}.rollout_is=token", f"{rc}.rollout_is_threshold=0.5_5.0",
                       f"{rc}.rollout_is_batch_normalize=True", f"{rc}.rollout_rs='seq_mean_k3,token_k1'",
                       f"{rc}.rollout_rs_threshold=[0.01,0.6_1.4]", f"reward.custom_reward_function.path={scorer}",
                       "reward.custom_reward_function.name=my_score",
                       "+reward.custom_reward_function.reward_kwargs.method=flexible"])[0]
    got = cfg.algorithm.rollout_correction
    assert (got.rollout_is_threshold, got.rollout_is_batch_normalize) == ("0.5_5.0", True)
    assert [(o.name, o.lower, o.upper) for o in got.rs_options()] == [("seq_mean_k3", None, 0.01),
                                                                      ("token_k1", 0.6, 1.4)]
    crf = cfg.custom_reward_function
    assert (crf.path, crf.name, crf.reward_kwargs) == (str(scorer), "my_score", {"method": "flexible"})
    for extra, said in ((f"custom_reward_function.path={scorer}", "custom_reward_function.path is given twice"),
                        ("reward.reward_model.enable=True", "a model reward is not supported")):
        with pytest.raises(ConfigError, match=said):
            launch.load([*args, f"reward.custom_reward_function.path={scorer}", extra])
