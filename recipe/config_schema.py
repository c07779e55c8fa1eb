"""Typed config: the Hydra YAML (verl's key names) becomes these dataclasses once, at start.

`PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))` builds the tree and validates
it: each dataclass checks its own fields in `__post_init__`, `PPOConfig` checks what spans
sections (batch sizes against the parallel layout, a model to train, the files to read), and
an unknown key anywhere is refused naming its full dotted path and the known keys of that
section. Errors name the key and the fix, before Ray or any engine starts.

Each part receives only its own piece: the agent loop an `AgentLoopConfig`, the Megatron
workers an `ActorConfig`, the losses a `PolicyLossConfig` / `ValueLossConfig`, the advantage
estimators an `AlgorithmConfig`; nothing below the entry point reads `config.a.b.c`.

Where it departs from verl's config: there is one micro-batch size per role (Megatron's
`ppo_micro_batch_size_per_gpu` also sizes the log-prob passes), the data-parallel size is
derived (`trainer.n_gpus_per_node * trainer.nnodes / (tp * pp)`), and `reward.*` weights the
reward kinds (outcome, tool step rewards, tools' final calc_reward, interaction scores).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_workers.actor import ActorConfig, OptimConfig
from recipe.algos import AlgorithmConfig, PolicyLossConfig, ValueLossConfig
from rollout.agent_loop import AgentLoopConfig, MultiTurnConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
LOGGERS = ("console", "wandb")


class ConfigError(ValueError):
    """A config value is missing, unknown or inconsistent; the message names the key and the fix."""


def resolve_path(value: str | None, key: str, must_exist: bool = True) -> str | None:
    """An absolute path for `value`: as given when it exists, else relative to the repository root."""
    if value is None:
        return None
    p = Path(value).expanduser()
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    if must_exist and not p.exists():
        raise ConfigError(f"{key}={value!r}: no such file or directory; give an existing path (absolute or "
                          "relative to the working directory or the polyturn checkout)")
    return str(p.resolve()) if p.exists() else str(p)


@dataclass
class DataConfig:
    """`data.*`: what to train on and how long prompts and responses may be."""

    train_files: list[str] = field(default_factory=list)  # verl-format parquet files (recipe.data.gsm8k writes them)
    train_batch_size: int = 256  # prompts per step (each rolled out `rollout.n` times)
    max_prompt_length: int = 1024  # longer prompts (chat template + tool schemas) are dropped at load
    max_response_length: int = 1024  # response-token budget per trajectory (sampled + tool + user tokens)
    shuffle: bool = True  # reshuffle the prompts every epoch (seeded by trainer.seed)

    def __post_init__(self) -> None:
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        if not self.train_files:
            raise ConfigError("data.train_files is empty; set it to the parquet file(s) to train on, e.g. "
                              "data.train_files=$HOME/data/gsm8k/train.parquet (python -m recipe.data.gsm8k makes them)")
        self.train_files = [resolve_path(f, "data.train_files") for f in self.train_files]
        for key in ("train_batch_size", "max_prompt_length", "max_response_length"):
            if getattr(self, key) < 1:
                raise ConfigError(f"data.{key} is {getattr(self, key)}; it must be >= 1")


@dataclass
class ModelConfig:
    """`actor_rollout_ref.model.*`: the policy's HF checkpoint."""

    path: str | None = None  # HF checkpoint directory, or a hub id downloaded at start (machines with internet)
    build_tiny: bool = False  # no path: write recipe.tiny_model's seeded checkpoint into the output dir (CPU preset)

    def __post_init__(self) -> None:
        if self.path is None and not self.build_tiny:
            raise ConfigError("actor_rollout_ref.model.path is not set; give an HF checkpoint directory "
                              "(actor_rollout_ref.model.path=/path/to/Qwen2.5-3B-Instruct), or "
                              "actor_rollout_ref.model.build_tiny=true for the tiny test model")
        if self.path is not None and not is_hub_id(self.path):
            self.path = resolve_path(self.path, "actor_rollout_ref.model.path")


def is_hub_id(value: str) -> bool:
    """True for a hub model id ("Qwen/Qwen2.5-3B-Instruct") that is not also a local path."""
    return (not Path(value).expanduser().exists() and value.count("/") == 1
            and not value.startswith(("/", ".", "~")))


@dataclass
class MegatronConfig:
    """`*.megatron.*`: the model-parallel layout (data parallelism fills the remaining ranks)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"megatron.{key} is {getattr(self, key)}; it must be >= 1")


@dataclass
class ActorSection:
    """`actor_rollout_ref.actor.*`: Megatron layout, optimizer, batching and the policy loss."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 64  # prompts per optimizer step (x rollout.n samples), as in verl
    ppo_micro_batch_size_per_gpu: int = 4  # samples per forward/backward on one rank (also for log-probs)
    use_dynamic_bsz: bool = False  # pack micro-batches by token count instead
    ppo_max_token_len_per_gpu: int = 16384  # token budget of a dynamic micro-batch
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"

    def __post_init__(self) -> None:
        self.policy_loss()  # validates the loss keys
        for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "ppo_max_token_len_per_gpu"):
            if getattr(self, key) < 1:
                raise ConfigError(f"actor_rollout_ref.actor.{key} is {getattr(self, key)}; it must be >= 1")

    def policy_loss(self) -> PolicyLossConfig:
        """The policy-loss settings (recipe.algos)."""
        names = {f.name for f in dataclasses.fields(PolicyLossConfig)}
        return PolicyLossConfig(**{k: getattr(self, k) for k in names})

    def worker_config(self, temperature: float, with_optimizer: bool = True) -> ActorConfig:
        """The Megatron worker's settings; `with_optimizer=False` gives the reference policy."""
        return ActorConfig(micro_batch_size=self.ppo_micro_batch_size_per_gpu, use_dynamic_bsz=self.use_dynamic_bsz,
                           max_token_len=self.ppo_max_token_len_per_gpu, ppo_epochs=self.ppo_epochs,
                           temperature=temperature, optim=self.optim if with_optimizer else None)


@dataclass
class RolloutSection:
    """`actor_rollout_ref.rollout.*`: SGLang engines and the agent loop."""

    name: str = "sglang"  # the only engine polyturn drives
    n: int = 1  # samples per prompt (GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    num_engines: int = 1  # SGLang engines the agent loop routes over
    tensor_model_parallel_size: int = 1  # GPUs per engine (SGLang tp_size)
    dtype: str = "bfloat16"  # engine weights dtype ("float32" for exact comparisons on CPU)
    gpu_memory_utilization: float = 0.5  # SGLang mem_fraction_static
    max_total_tokens: int | None = None  # KV-cache size in tokens; None: SGLang sizes it (always set on CPU)
    max_model_len: int | None = None  # prompt + response limit per trajectory; None: only the response budget
    update_weights_bucket_megabytes: int = 512  # weight-sync bucket size
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

    def __post_init__(self) -> None:
        if self.name != "sglang":
            raise ConfigError(f"actor_rollout_ref.rollout.name is {self.name!r}; polyturn drives SGLang only: use sglang")
        for key in ("n", "num_engines", "tensor_model_parallel_size", "update_weights_bucket_megabytes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"actor_rollout_ref.rollout.{key} is {getattr(self, key)}; it must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"actor_rollout_ref.rollout.gpu_memory_utilization is {self.gpu_memory_utilization}; "
                              "it must lie in (0, 1]")
        mt = self.multi_turn
        mt.tool_config_path = resolve_path(mt.tool_config_path, "actor_rollout_ref.rollout.multi_turn.tool_config_path")
        mt.interaction_config_path = resolve_path(
            mt.interaction_config_path, "actor_rollout_ref.rollout.multi_turn.interaction_config_path")

    def agent_loop_config(self, response_length: int) -> AgentLoopConfig:
        """The agent loop's settings (`response_length` comes from data.max_response_length)."""
        return AgentLoopConfig(n=self.n, response_length=response_length, max_model_len=self.max_model_len,
                               temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                               multi_turn=self.multi_turn)


@dataclass
class ActorRolloutRefConfig:
    """`actor_rollout_ref.*`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorSection = field(default_factory=ActorSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)


@dataclass
class CriticConfig:
    """`critic.*`: the value model, built from the policy's checkpoint (used by adv_estimator=gae)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 64  # prompts per optimizer step, as for the actor
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        self.value_loss()
        for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"critic.{key} is {getattr(self, key)}; it must be >= 1")

    def value_loss(self) -> ValueLossConfig:
        """The value-loss settings (recipe.algos)."""
        return ValueLossConfig(cliprange_value=self.cliprange_value, loss_agg_mode=self.loss_agg_mode,
                               loss_scale_factor=self.loss_scale_factor)

    def worker_config(self) -> ActorConfig:
        """The Megatron critic worker's settings."""
        return ActorConfig(micro_batch_size=self.ppo_micro_batch_size_per_gpu, ppo_epochs=self.ppo_epochs,
                           optim=self.optim)


@dataclass
class RewardConfig:
    """`reward.*`: weights of the rewards a trajectory earns (see recipe.trainer and recipe.algos.place_token_rewards)."""

    outcome_weight: float = 1.0  # the data source's scorer on the final answer
    tool_weight: float = 1.0  # each tool call's step reward, at the end of the calling turn
    tool_final_weight: float = 0.0  # each tool's final calc_reward (e.g. best gsm8k score), on the last sampled token
    interaction_weight: float = 0.0  # each interaction turn's score, at the end of the graded turn


@dataclass
class TrainerConfig:
    """`trainer.*`: run length, resources, logging."""

    project_name: str = "polyturn"
    experiment_name: str = "run"
    logger: list[str] = field(default_factory=lambda: ["console"])  # any of console, wandb
    total_training_steps: int = 1
    seed: int = 0
    default_local_dir: str = "outputs/run"  # metrics.jsonl, wandb files, the tiny model (CPU preset)
    n_gpus_per_node: int = 1  # Megatron ranks per node (CPU processes without a GPU)
    nnodes: int = 1

    def __post_init__(self) -> None:
        unknown = [x for x in self.logger if x not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.logger has {unknown}; use a list of {LOGGERS}, e.g. trainer.logger=[console,wandb]")
        for key in ("total_training_steps", "n_gpus_per_node", "nnodes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key} is {getattr(self, key)}; it must be >= 1")
        self.default_local_dir = str(Path(self.default_local_dir).expanduser().resolve())


@dataclass
class RayInitConfig:
    """`ray_init.*`: the local Ray cluster."""

    num_cpus: int | None = None  # CPUs Ray may use; None: all of this machine's
    temp_dir: str | None = None  # Ray's session directory; None: Ray's default (or $RAY_TMPDIR)


@dataclass
class PPOConfig:
    """The whole run."""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)

    def __post_init__(self) -> None:
        actor, rollout = self.actor_rollout_ref.actor, self.actor_rollout_ref.rollout
        mp = actor.megatron.tensor_model_parallel_size * actor.megatron.pipeline_model_parallel_size
        world = self.trainer.n_gpus_per_node * self.trainer.nnodes
        if world % mp:
            raise ConfigError(
                f"trainer.n_gpus_per_node * trainer.nnodes = {world} ranks is not a multiple of tensor x pipeline "
                f"parallel size = {mp}; change actor_rollout_ref.actor.megatron.* or the rank count")
        sections = [("actor_rollout_ref.actor", actor.ppo_mini_batch_size)]
        if self.use_critic:
            sections.append(("critic", self.critic.ppo_mini_batch_size))
        for prefix, mini in sections:
            if self.data.train_batch_size % mini:
                raise ConfigError(f"{prefix}.ppo_mini_batch_size={mini} does not divide data.train_batch_size="
                                  f"{self.data.train_batch_size}; choose a divisor")
            if (mini * rollout.n) % self.dp_size:
                raise ConfigError(f"{prefix}.ppo_mini_batch_size * rollout.n = {mini * rollout.n} samples cannot be "
                                  f"split over {self.dp_size} data-parallel ranks; make it a multiple of the DP size")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the actor."""
        m = self.actor_rollout_ref.actor.megatron
        world = self.trainer.n_gpus_per_node * self.trainer.nnodes
        return world // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size)

    @property
    def use_reference(self) -> bool:
        """A reference policy is needed for a KL loss or a KL penalty in the reward."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def use_critic(self) -> bool:
        """A critic is needed for GAE."""
        return self.algorithm.adv_estimator == "gae"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PPOConfig:
        """Build and validate from a plain nested dict (`OmegaConf.to_container(cfg, resolve=True)`)."""
        d = {k: v for k, v in d.items() if k != "hydra"}
        return _build(cls, d, "")


def _build(cls: type, d: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from mapping `d`, recursing into dataclass-typed fields."""
    where = prefix.rstrip(".") or "the config root"
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__} {d!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s) {[prefix + k for k in unknown]}; {where} has {sorted(names)} "
                          "(check the spelling, or add the key to recipe/config_schema.py)")
    kwargs = {}
    for key, value in d.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and value is not None:
            kwargs[key] = _build(hint, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_type(value, hint, prefix + key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: {err}") from err


_SCALARS = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}


def _check_type(value: Any, hint: Any, key: str) -> Any:
    """Refuse a scalar of the wrong type (e.g. a string where a number belongs); ints pass as floats."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} is null; it needs a value of type {hint}")
    for option in options:
        accepted = _SCALARS.get(option)
        if accepted is None:
            return value  # lists and other containers: the dataclass checks them
        if isinstance(value, accepted) and not (option is not bool and isinstance(value, bool)):
            return float(value) if option is float else value
    raise ConfigError(f"{key}={value!r} has type {type(value).__name__}; it must be {hint}")


def flat_keys(cls: type = PPOConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key the config accepts (the public config surface)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys.extend(flat_keys(hint, f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return sorted(keys)
