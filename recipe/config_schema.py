"""Typed config: the Hydra YAML (verl's key names) becomes these dataclasses once, at start.

`PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))` builds the tree and validates
it: each dataclass checks its own fields in `__post_init__`, `PPOConfig` checks what spans
sections (batch sizes against the parallel layout, the files to read). The generic builder (an
unknown key anywhere refused naming its full dotted path and the known keys of that section),
the defaults and the Hydra registration live in `recipe.config_build`; this module holds the
declarations and their checks only. Errors name the key and the fix, before Ray or any engine
starts. Importing this module loads neither Megatron nor SGLang, and registers nothing.

Each field is declared once, with a docstring under it, in the dataclass of the part that
reads it (the sections SFT shares too are `recipe.config_shared`'s), and the parts receive
their sections as they are: `actor_rollout_ref.actor` is the
Megatron rank's `ActorConfig` (megatron_workers.config) and the policy loss's
`PolicyLossConfig` (recipe.algos) in one class; `critic` likewise with `ValueLossConfig`;
`actor_rollout_ref.rollout` is the agent loop's `RolloutConfig` (rollout.config); `algorithm`
is the estimators' `AlgorithmConfig`; `reward` and `custom_reward_function` are recipe.reward's.
Nothing below the entry point reads `config.a.b.c`.

Where it departs from verl's config: there is one micro-batch size per role (Megatron's
`ppo_micro_batch_size_per_gpu` also sizes the log-prob passes), the data-parallel size is
derived (`trainer.n_gpus_per_node * trainer.nnodes / (tp * pp)`), and `reward.*` weights the
reward kinds (outcome, tool step rewards, tools' final calc_reward, interaction scores).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_workers.config import ActorConfig, OptimConfig, WorkerConfig
from recipe.algos import AlgorithmConfig, PolicyLossConfig, ValueLossConfig
from recipe.algos.registry import ADV_ESTIMATORS, EstimatorSpec
from recipe.checkpoint import RESUME_MODES
from recipe.config_build import ConfigError, build
from recipe.async_config import AsyncTrainingConfig
from recipe.config_shared import DataFiles, ModelSection, RayInitConfig, RunConfig, is_hub_id, resolve_path
from recipe.reward import CustomRewardFunctionConfig, RewardConfig
from recipe.weight_sync import MODES as SYNC_MODES
from rollout.config import RolloutConfig

ROLE_KEYS = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic"}
"""The config section of each Megatron role."""


@dataclass
class DataConfig(DataFiles):
    """`data.*` of RL: the files, and how long prompts and responses may be."""

    max_prompt_length: int = 1024
    """Longer prompts (chat template + tool schemas) are dropped at load."""
    max_response_length: int = 1024
    """Response-token budget per trajectory (sampled + tool + user tokens); rollout.response_length follows it."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded by trainer.seed)."""
    train_max_samples: int = -1
    """Read only this many training prompts (the first, or a draw seeded by trainer.seed with shuffle:
    recipe/data/samples.py); -1: all."""
    val_max_samples: int = -1
    """Likewise for the validation prompts; -1: all."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template (verl's key; e.g. `enable_thinking: false`), passed to every render:
    the prompt at load (what the length filter measures) and every later turn of the rollout."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("max_prompt_length", "max_response_length"):
            if getattr(self, key) < 1:
                raise ConfigError(f"data.{key} is {getattr(self, key)}; it must be >= 1")
        owned = sorted(set(self.apply_chat_template_kwargs) & {"conversation", "tools", "add_generation_prompt",
                                                              "tokenize", "continue_final_message", "return_dict"})
        if owned:
            raise ConfigError(f"data.apply_chat_template_kwargs sets {owned}, which the rollout sets on each render "
                              "(the sample's tools, the generation prompt); drop them")


@dataclass
class ModelConfig(ModelSection):
    """`actor_rollout_ref.model.*`: the policy's HF checkpoint."""

    path: str | None = None
    """HF checkpoint directory, or a hub id downloaded at start (machines with internet)."""
    build_tiny: bool = False
    """No path: write recipe.tiny_model's seeded checkpoint into the output dir (CPU preset)."""
    trust_remote_code: bool = False
    """Let the checkpoint's own code run where transformers and SGLang load its config and tokenizer (verl's key);
    the Megatron model is always polyturn's adapter."""

    def __post_init__(self) -> None:
        if self.path is None and not self.build_tiny:
            raise ConfigError("actor_rollout_ref.model.path is not set; give an HF checkpoint directory "
                              "(actor_rollout_ref.model.path=/path/to/Qwen2.5-3B-Instruct), or "
                              "actor_rollout_ref.model.build_tiny=true for the tiny test model")
        if self.path is not None and not is_hub_id(self.path):
            self.path = resolve_path(self.path, "actor_rollout_ref.model.path")


@dataclass
class ActorSection(ActorConfig, PolicyLossConfig):
    """`actor_rollout_ref.actor.*`: the Megatron policy ranks' `ActorConfig` and the `PolicyLossConfig`, as one section.

    The ranks and the policy loss both receive this object as it is; the reference policy is
    the same section with `optim=None`.
    """

    optim: OptimConfig | None = field(default_factory=lambda: OptimConfig(weight_decay=0.01))
    """The policy's optimizer and LR schedule (verl's actor defaults: weight decay 0.01)."""

    def __post_init__(self) -> None:
        ActorConfig.__post_init__(self)
        PolicyLossConfig.__post_init__(self)


@dataclass
class CriticSection(WorkerConfig, ValueLossConfig):
    """`critic.*`: the value model (built from the policy's checkpoint, used by adv_estimator=gae): its
    ranks' `WorkerConfig` and the `ValueLossConfig`, as one section."""

    optim: OptimConfig | None = field(default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.01))
    """The value model's optimizer and LR schedule (verl's critic defaults: lr 1e-5, weight decay 0.01)."""
    model: ModelSection = field(default_factory=ModelSection)
    """How the value model is built."""

    def __post_init__(self) -> None:
        WorkerConfig.__post_init__(self)
        ValueLossConfig.__post_init__(self)
        if self.model.enable_gradient_checkpointing:
            self.megatron.recompute_activations()


@dataclass
class RefMegatronConfig:
    """`actor_rollout_ref.ref.megatron.*`: the reference's own model-parallel layout (verl's keys); its ranks are a
    Megatron group of their own on the same bundles, so data parallelism fills the rest. Its other Megatron settings
    are the actor's: offload moves every role with the actor's flags, and the KL term needs the actor's dtype."""

    tensor_model_parallel_size: int | None = None
    """Ranks that split each of the reference's layers (Megatron TP); None: the actor's."""
    pipeline_model_parallel_size: int | None = None
    """Ranks that split the reference's layers into stages (Megatron PP); None: the actor's."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per reference pipeline rank (Megatron's virtual pipeline stages); None: the actor's."""

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"actor_rollout_ref.ref.megatron.{key} is {getattr(self, key)}; it must be >= 1 "
                                  "(or null: the actor's)")


@dataclass
class RefSection:
    """`actor_rollout_ref.ref.*`: the reference policy is the actor's section without an optimizer, with a layout and
    forward-pass sizes of its own where given (verl's keys)."""

    megatron: RefMegatronConfig = field(default_factory=RefMegatronConfig)
    """The reference's own parallel layout."""

    log_prob_micro_batch_size_per_gpu: int | None = None
    """Samples per reference log-prob pass on one rank; None: the actor's log_prob_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Pack the reference pass's micro-batches by token count; None: the actor's log_prob_use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget of one dynamic reference micro-batch; None: the actor's log_prob_max_token_len_per_gpu."""

    def __post_init__(self) -> None:
        for key in ("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"actor_rollout_ref.ref.{key} is {getattr(self, key)}; it must be >= 1 (or null)")

    def reference(self, actor: ActorSection) -> ActorSection:
        """The reference ranks' config: the actor's section, forward only, with this section's layout and pass
        sizes where given."""
        def given(section: Any) -> dict[str, Any]:
            return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                    if f.name != "megatron" and getattr(section, f.name) is not None}

        megatron = dataclasses.replace(actor.megatron, **given(self.megatron))
        return dataclasses.replace(actor, optim=None, megatron=megatron, **given(self))


@dataclass
class ActorRolloutRefConfig:
    """`actor_rollout_ref.*`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy checkpoint."""
    actor: ActorSection = field(default_factory=ActorSection)
    """The policy's (and reference's) Megatron ranks and loss."""
    ref: RefSection = field(default_factory=RefSection)
    """The reference policy's own layout and pass sizes."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The SGLang engines and the agent loop."""
    hybrid_engine: bool = True
    """Placement mode (recipe.placement): true = hybrid, the engines share the trainer's GPUs with the
    actor, ref and critic ranks; false = separate, the engines get their own pool (top-level `rollout.*`)."""

    def __post_init__(self) -> None:
        if self.model.enable_gradient_checkpointing:
            self.actor.megatron.recompute_activations()
        if self.rollout.update_weights_mode not in (None, *SYNC_MODES):
            raise ConfigError(f"actor_rollout_ref.rollout.update_weights_mode is {self.rollout.update_weights_mode!r}; "
                              f"use one of {SYNC_MODES} or null (by placement mode)")


@dataclass
class TrainerConfig(RunConfig):
    """`trainer.*` of RL: run length, resources, output and logging, and the RL loop's own settings."""

    val_before_train: bool = True
    """Validate once before the first step (when data.val_files is set)."""
    val_only: bool = False
    """Validate once (with val_before_train) and stop without training (verl's val_only)."""
    log_val_generations: int = 0
    """Validation samples logged as a table (`val/generations`) at each validation; 0: none."""
    rollout_data_dir: str | None = None
    """Directory of one `<step>.jsonl` per step with each trajectory's prompt, response, tool calls, rewards,
    finish reason, token ids, mask, log-probs, weight versions and turn spans (`python -m recipe.show_trajectory`
    prints one); None: not written."""
    validation_data_dir: str | None = None
    """The same per validation (`<step>.jsonl`, step 0 = before training); None: not written."""
    seed: int = 0
    """Seed of the data order, the tiny model and the engines' sampling (with actor_rollout_ref.rollout.deterministic,
    of every trajectory's sampling seed)."""
    rollout_timeout_s: float | None = None
    """Wall-clock limit of one step's rollout: past it the agent loop is aborted and the step trains on what was
    sampled so far; None: no limit."""
    critic_warmup: int = 0
    """verl's critic warm-up: the actor is updated (and its weights synced to the engines) from step critic_warmup on
    (verl's `critic_warmup <= global_steps`, steps counted from 1); the steps before it update the critic only.
    0 or 1: the actor updates from the first step."""
    max_failed_fraction: float = 0.5
    """A step where more than this fraction of the trajectories ended in error (engine, interaction, tool-session
    failures) is not trained on (logged and counted, `fault/skipped_steps`)."""
    max_failed_steps: int = 3
    """Steps in a row that train nothing (too many failed trajectories, or none with a sampled token) that stop the
    run with a non-zero exit."""
    collective_timeout_s: float = 1800.0
    """Seconds a Megatron collective may wait for its peers (the torch.distributed process-group timeout) before it
    fails and stops the run, naming the role and rank; a rank that dies stops it at once."""
    save_freq: int = -1
    """Save a checkpoint (recipe.checkpoint) every this many steps and after the last step; -1: never."""
    resume_mode: str = "auto"
    """auto: continue from the newest complete checkpoint in default_local_dir (its
    latest_checkpointed_iteration.txt), or start over when there is none; disable: start over;
    resume_path: continue from trainer.resume_from_path."""
    resume_from_path: str | None = None
    """A `<default_local_dir>/global_step_<k>` directory to continue from (read with resume_mode=resume_path)."""
    max_actor_ckpt_to_keep: int | None = None
    """Checkpoints kept in default_local_dir (actor, critic and trainer state together); the oldest are removed once
    a new one is complete; None: keep all."""
    peak_tflops_per_gpu: float | None = None
    """Dense BF16 peak TFLOPS of one trainer device, for `perf/mfu/actor` (recipe.flops); None: looked up by the
    GPU type Ray reports (recipe.flops.PEAK_TFLOPS), and no MFU is logged for a device not listed there (a CPU)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.peak_tflops_per_gpu is not None and self.peak_tflops_per_gpu <= 0:
            raise ConfigError(f"trainer.peak_tflops_per_gpu is {self.peak_tflops_per_gpu}; give the device's peak "
                              "TFLOPS (> 0), or null to look it up by GPU type")
        if not 0 <= self.max_failed_fraction < 1:
            raise ConfigError(f"trainer.max_failed_fraction is {self.max_failed_fraction}; it must lie in [0, 1)")
        if self.critic_warmup < 0:
            raise ConfigError(f"trainer.critic_warmup is {self.critic_warmup}; it must be >= 0")
        if self.max_failed_steps < 1:
            raise ConfigError(f"trainer.max_failed_steps is {self.max_failed_steps}; it must be >= 1")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"trainer.collective_timeout_s is {self.collective_timeout_s}; it must be > 0")
        if self.rollout_timeout_s is not None and self.rollout_timeout_s <= 0:
            raise ConfigError(f"trainer.rollout_timeout_s is {self.rollout_timeout_s}; it must be > 0 (or null)")
        if self.log_val_generations < 0:
            raise ConfigError(f"trainer.log_val_generations is {self.log_val_generations}; it must be >= 0")
        if self.save_freq == 0 or self.save_freq < -1:
            raise ConfigError(f"trainer.save_freq is {self.save_freq}; use a step count >= 1, or -1 for no checkpoints")
        if self.resume_mode not in RESUME_MODES:
            raise ConfigError(f"trainer.resume_mode={self.resume_mode!r}; use one of {RESUME_MODES}")
        if self.resume_mode == "resume_path":
            if self.resume_from_path is None:
                raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path="
                                  "<default_local_dir>/global_step_<k>")
            self.resume_from_path = resolve_path(self.resume_from_path, "trainer.resume_from_path")
        if self.max_actor_ckpt_to_keep is not None and self.max_actor_ckpt_to_keep < 1:
            raise ConfigError(f"trainer.max_actor_ckpt_to_keep is {self.max_actor_ckpt_to_keep}; it must be >= 1 "
                              "(or null to keep all)")
        for key in ("rollout_data_dir", "validation_data_dir"):
            if getattr(self, key) is not None:
                setattr(self, key, str(Path(getattr(self, key)).expanduser().resolve()))


@dataclass
class RolloutPoolConfig:
    """`rollout.*` (verl's top-level section): the engines' own GPUs, used with actor_rollout_ref.hybrid_engine=false."""

    nnodes: int | None = None
    """Nodes of the engines' pool."""
    n_gpus_per_node: int | None = None
    """GPUs per node of the engines' pool."""

    def __post_init__(self) -> None:
        for key in ("nnodes", "n_gpus_per_node"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"rollout.{key} is {getattr(self, key)}; it must be >= 1 (or null)")


@dataclass
class PPOConfig:
    """The whole run."""

    data: DataConfig = field(default_factory=DataConfig)
    """`data.*`."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """`actor_rollout_ref.*`."""
    critic: CriticSection = field(default_factory=CriticSection)
    """`critic.*`."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """`algorithm.*`."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """`reward.*`."""
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """`custom_reward_function.*`."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """`trainer.*`."""
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    """`rollout.*`."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """`async_training.*`."""
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    """`ray_init.*`."""

    def __post_init__(self) -> None:
        rollout, t = self.actor_rollout_ref.rollout, self.trainer
        if (t.test_freq > 0 or t.log_val_generations or t.validation_data_dir) and not self.data.val_files:
            raise ConfigError("trainer.test_freq / log_val_generations / validation_data_dir ask for validation but "
                              "data.val_files is empty; set data.val_files=[path/to/test.parquet] or drop them")
        if t.val_only and not (t.val_before_train and self.data.val_files):
            raise ConfigError("trainer.val_only=True validates once before training and stops: it needs "
                              "trainer.val_before_train=True and data.val_files; set them or drop trainer.val_only")
        schedule = self.async_training.schedule
        if self.async_training.separate_pool and self.actor_rollout_ref.hybrid_engine:
            raise ConfigError(f"async_training.schedule={schedule} rolls out while the trainer trains, so the engines "
                              "need GPUs of their own: set actor_rollout_ref.hybrid_engine=false with rollout.nnodes "
                              "and rollout.n_gpus_per_node (their pool)")
        if schedule == "fully_async" and self.estimator.needs_greedy_rollout:
            raise ConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} rolls out a greedy baseline of "
                              "each step's prompt batch, and async_training.schedule=fully_async streams prompt groups "
                              "with no batch; use grpo, or async_training.schedule=one_step_off")
        if t.critic_warmup > 1 and not self.use_critic:
            raise ConfigError(f"trainer.critic_warmup={t.critic_warmup} warms up a critic, and "
                              f"algorithm.adv_estimator={self.algorithm.adv_estimator} has none: its first "
                              f"{t.critic_warmup - 1} steps would train nothing; drop the key (or set 0), or use "
                              "an estimator with a critic (algorithm.adv_estimator=gae)")
        mt = rollout.multi_turn
        mt.tool_config_path = resolve_path(mt.tool_config_path, "actor_rollout_ref.rollout.multi_turn.tool_config_path")
        mt.function_tool_path = resolve_path(mt.function_tool_path,
                                             "actor_rollout_ref.rollout.multi_turn.function_tool_path")
        mt.interaction_config_path = resolve_path(
            mt.interaction_config_path, "actor_rollout_ref.rollout.multi_turn.interaction_config_path")
        self.custom_reward_function.path = resolve_path(self.custom_reward_function.path, "custom_reward_function.path")
        for role, worker in self.workers().items():
            self.trainer.dp_size(worker.megatron, f"{ROLE_KEYS[role]}.megatron")
            if getattr(worker, "loss_scale_factor", 0) is None:  # verl's horizon: the width it pads responses to
                worker.loss_scale_factor = float(rollout.response_length)
        for role, worker in self.workers().items():
            if worker.optim is None:  # the reference trains nothing: any batch of whole rows splits (batch_multiple)
                continue
            prefix, mini, dp = ROLE_KEYS[role], worker.ppo_mini_batch_size, self.role_dp_size(worker)
            if self.data.train_batch_size % mini:
                raise ConfigError(f"{prefix}.ppo_mini_batch_size={mini} does not divide data.train_batch_size="
                                  f"{self.data.train_batch_size}; choose a divisor")
            if (mini * rollout.n) % dp:
                raise ConfigError(f"{prefix}.ppo_mini_batch_size * rollout.n = {mini * rollout.n} samples cannot be "
                                  f"split over {dp} data-parallel ranks; make it a multiple of the DP size")
            pp, per_rank = worker.megatron.pipeline_model_parallel_size, mini * rollout.n // dp
            if worker.megatron.vpp > 1 and per_rank < pp:
                raise ConfigError(f"{prefix}.megatron.virtual_pipeline_model_parallel_size={worker.megatron.vpp} needs at "
                                  f"least pipeline_model_parallel_size={pp} samples per rank in each mini-batch, and "
                                  f"{prefix}.ppo_mini_batch_size * rollout.n / {dp} DP ranks = {per_rank}; raise "
                                  f"{prefix}.ppo_mini_batch_size or drop virtual_pipeline_model_parallel_size")

    def workers(self) -> dict[str, WorkerConfig]:
        """The Megatron roles this run builds, each with the section its ranks receive: actor; ref when a KL term
        is used (`RefSection.reference`); critic when the estimator needs one (GAE)."""
        ar = self.actor_rollout_ref
        roles: dict[str, WorkerConfig] = {"actor": ar.actor}
        if self.use_reference:
            roles["ref"] = ar.ref.reference(ar.actor)
        if self.use_critic:
            roles["critic"] = self.critic
        return roles

    def role_dp_size(self, worker: WorkerConfig) -> int:
        """Data-parallel ranks of a role: all trainer ranks over its tensor x pipeline parallel size."""
        return self.trainer.dp_size(worker.megatron)

    @property
    def batch_multiple(self) -> int:
        """Rows a step's batch must be a multiple of, to split evenly over every role's mini-batches x DP ranks."""
        prompts = self.data.train_batch_size
        return math.lcm(*(self.role_dp_size(w) * (prompts // w.ppo_mini_batch_size if w.optim is not None else 1)
                          for w in self.workers().values()))

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the actor."""
        return self.role_dp_size(self.actor_rollout_ref.actor)

    def total_steps(self, batches_per_epoch: int) -> int:
        """Steps of the run: trainer.total_training_steps when set, else total_epochs x batches per epoch."""
        t = self.trainer
        return t.total_training_steps if t.total_training_steps is not None else t.total_epochs * batches_per_epoch

    @property
    def use_reference(self) -> bool:
        """A reference policy is needed for a KL loss or a KL penalty in the reward."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def estimator(self) -> EstimatorSpec:
        """The advantage estimator's registry entry: what it needs (a critic, a greedy rollout, its inputs)."""
        return ADV_ESTIMATORS[self.algorithm.adv_estimator]

    @property
    def use_critic(self) -> bool:
        """A critic is needed when the estimator reads values (GAE)."""
        return self.estimator.needs_critic

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PPOConfig:
        """Build and validate from a plain nested dict (`OmegaConf.to_container(cfg, resolve=True)`)."""
        return build(cls, d)
