"""The SFT entry's typed config: `recipe/config/sft_trainer.yaml` (verl's fsdp_sft_trainer key names) as dataclasses.

`SFTConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))` builds and validates the tree
with the RL config's builder (`recipe.config_schema`): unknown keys are refused naming their
dotted path, each section checks its own fields, errors name the key and the fix, all before
Ray starts. `check_overrides(argv)` does the same for command-line overrides before Hydra
composes, so a verl key polyturn's SFT does not take is named with what to use instead
(instead of Hydra's bare "not in struct").

Where it departs from verl's `sft_trainer.yaml`: the model trains on Megatron ranks
(`megatron.*` sets the layout, `optim.*` is the RL actor's Megatron optimizer section, so
`optim.betas` / `warmup_steps_ratio` / `lr_scheduler` are `adam_beta1/2`, `lr_warmup_steps`,
`lr_decay_style` + `lr_decay_steps`), the data is multi-turn only, the seed is the top-level
`seed`, and the output is one HF directory at the end (no intermediate checkpoints).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_workers.config import MegatronConfig, OptimConfig
from recipe.config_schema import LOGGERS, ConfigError, RayInitConfig, _build, flat_keys, is_hub_id, resolve_path
from recipe.data.sft_dataset import TRUNCATIONS


@dataclass
class SFTMultiTurnConfig:
    """`data.multiturn.*`: where the chat lives in a row."""

    enable: bool = True
    """verl's switch for the multi-turn dataset; polyturn's SFT reads multi-turn rows only (false is refused)."""
    messages_key: str = "messages"
    """Column holding the chat messages (role, content, optional tool_calls)."""
    tools_key: str = "tools"
    """Column holding the row's OpenAI function schemas (a list or a JSON string); a missing column: no tools."""

    def __post_init__(self) -> None:
        if not self.enable:
            raise ConfigError("data.multiturn.enable=false: polyturn's SFT reads multi-turn rows only; write each "
                              "prompt/response pair as a `messages` column ([user, assistant]) and drop the key")


@dataclass
class SFTDataConfig:
    """`data.*`: demonstrations and batch sizes."""

    train_files: list[str] = field(default_factory=list)
    """verl multi-turn SFT parquet files (a messages column, an optional tools column)."""
    val_files: list[str] = field(default_factory=list)
    """Parquet files of the same format whose loss is measured (val/loss) every trainer.test_freq steps and at the
    end; empty: no validation."""
    train_batch_size: int = 256
    """Conversations per optimizer step, over all data-parallel ranks."""
    micro_batch_size_per_gpu: int = 4
    """Conversations per forward/backward on one rank (also the validation pass)."""
    max_length: int = 1024
    """Token budget of one conversation (prompt + every turn); longer ones follow data.truncation."""
    truncation: str = "error"
    """error: refuse a longer conversation naming its row; right: cut the end of its response."""
    multiturn: SFTMultiTurnConfig = field(default_factory=SFTMultiTurnConfig)
    """Column names."""

    def __post_init__(self) -> None:
        self.train_files = [self.train_files] if isinstance(self.train_files, str) else self.train_files
        self.val_files = [self.val_files] if isinstance(self.val_files, str) else self.val_files
        if not self.train_files:
            raise ConfigError("data.train_files is empty; set it to the multi-turn SFT parquet file(s), e.g. "
                              "data.train_files=[$HOME/data/sft/train.parquet]")
        self.train_files = [resolve_path(f, "data.train_files") for f in self.train_files]
        self.val_files = [resolve_path(f, "data.val_files") for f in self.val_files]
        for key in ("train_batch_size", "micro_batch_size_per_gpu", "max_length"):
            if getattr(self, key) < 1:
                raise ConfigError(f"data.{key} is {getattr(self, key)}; it must be >= 1")
        if self.truncation not in TRUNCATIONS:
            raise ConfigError(f"data.truncation={self.truncation!r}; use one of {TRUNCATIONS}")


@dataclass
class SFTModelConfig:
    """`model.*`: the checkpoint to start from."""

    partial_pretrain: str | None = None
    """HF checkpoint directory (or a hub id, downloaded at start) whose tokenizer's chat template is the rollout's."""

    def __post_init__(self) -> None:
        if self.partial_pretrain is None:
            raise ConfigError("model.partial_pretrain is not set; give an HF checkpoint directory, e.g. "
                              "model.partial_pretrain=/models/Qwen2.5-0.5B-Instruct")
        if not is_hub_id(self.partial_pretrain):
            self.partial_pretrain = resolve_path(self.partial_pretrain, "model.partial_pretrain")


@dataclass
class SFTTrainerConfig:
    """`trainer.*`: run length, resources, output and logging."""

    default_local_dir: str = "outputs/sft"
    """Output directory: `hf/` (the trained model, an HF directory), metrics.jsonl, wandb files."""
    project_name: str = "polyturn-sft"
    """Project name (wandb project)."""
    experiment_name: str = "sft"
    """Run name (wandb run)."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Metric sinks, any of console, wandb."""
    total_epochs: int = 1
    """Passes over the training data (each reshuffled, seeded by `seed`) when total_training_steps is null."""
    total_training_steps: int | None = None
    """Optimizer steps to train; null: total_epochs x (rows // data.train_batch_size)."""
    test_freq: int = -1
    """Measure the validation loss every this many steps (and always at the end, with data.val_files); -1: end only."""
    n_gpus_per_node: int = 1
    """GPUs (Megatron ranks) per node; on a Ray cluster without GPUs, a CPU-share bundle each."""
    nnodes: int = 1
    """Nodes; more than one: join a Ray cluster (RAY_ADDRESS)."""

    def __post_init__(self) -> None:
        unknown = [x for x in self.logger if x not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.logger has {unknown}; use a list of {LOGGERS}, e.g. trainer.logger=[console,wandb]")
        for key in ("total_epochs", "total_training_steps", "n_gpus_per_node", "nnodes"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key} is {getattr(self, key)}; it must be >= 1")
        if self.test_freq == 0 or self.test_freq < -1:
            raise ConfigError(f"trainer.test_freq is {self.test_freq}; use a step count >= 1, or -1 (end only)")
        self.default_local_dir = str(Path(self.default_local_dir).expanduser().resolve())


@dataclass
class SFTConfig:
    """The whole SFT run."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """`data.*`."""
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    """`model.*`."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """`optim.*`: Megatron's Adam and LR schedule (the RL actor's section)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """`megatron.*`: tensor / pipeline parallel sizes (data parallelism fills the other ranks)."""
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    """`trainer.*`."""
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    """`ray_init.*`."""
    seed: int = 0
    """Seed of the data order and Megatron's RNG."""

    def __post_init__(self) -> None:
        m = self.megatron
        for key in ("param_offload", "grad_offload", "optimizer_offload"):
            if getattr(m, key):
                raise ConfigError(f"megatron.{key}=true: offloading makes room for colocated engines in RL; SFT has "
                                  "none, drop the key")
        mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
        world = self.trainer.n_gpus_per_node * self.trainer.nnodes
        if world % mp:
            raise ConfigError(f"trainer.n_gpus_per_node * trainer.nnodes = {world} ranks is not a multiple of tensor x "
                              f"pipeline parallel size = {mp}; change megatron.* or the rank count")
        if self.data.train_batch_size % self.dp_size:
            raise ConfigError(f"data.train_batch_size={self.data.train_batch_size} cannot be split over {self.dp_size} "
                              "data-parallel ranks; make it a multiple of the DP size")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks."""
        m = self.megatron
        return self.trainer.n_gpus_per_node * self.trainer.nnodes // (m.tensor_model_parallel_size *
                                                                      m.pipeline_model_parallel_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SFTConfig:
        """Build and validate from a plain nested dict (`OmegaConf.to_container(cfg, resolve=True)`)."""
        d = {k: v for k, v in d.items() if k != "hydra"}
        for key in _leaf_keys(d):
            _refuse(key)
        return _build(cls, d, "")


# verl fsdp_sft_trainer keys polyturn's SFT refuses by name (a key, or a section with everything under it).
UNSUPPORTED: dict[str, str] = {
    "trainer.seed": "the seed is the top-level key: seed=<n>",
    "trainer.save_freq": "SFT writes one HF directory, <trainer.default_local_dir>/hf, at the end; drop the key",
    "trainer.max_ckpt_to_keep": "SFT writes one HF directory at the end; drop the key",
    "trainer.resume_path": "SFT does not resume; start a new run from an exported HF dir (model.partial_pretrain)",
    "trainer.resume_mode": "SFT does not resume; start a new run from an exported HF dir (model.partial_pretrain)",
    "trainer.default_hdfs_dir": "outputs go to trainer.default_local_dir only; drop the key",
    "trainer.device": "the device follows the Ray cluster (GPUs when it has them); drop the key",
    "trainer.checkpoint": "SFT writes one HF directory at the end; drop the key",
    "optim.betas": "use optim.adam_beta1 and optim.adam_beta2",
    "optim.warmup_steps_ratio": "use optim.lr_warmup_steps (optimizer steps)",
    "optim.lr_scheduler": "use optim.lr_decay_style (constant, linear, cosine, ...) with optim.lr_decay_steps",
    "data.micro_batch_size": "give the per-GPU size data.micro_batch_size_per_gpu",
    "data.prompt_key": "polyturn's SFT is multi-turn only: write rows as a messages column (data.multiturn.messages_key)",
    "data.response_key": "polyturn's SFT is multi-turn only: write rows as a messages column",
    "data.prompt_dict_keys": "polyturn's SFT is multi-turn only: write rows as a messages column",
    "data.response_dict_keys": "polyturn's SFT is multi-turn only: write rows as a messages column",
    "data.chat_template": "the model directory's tokenizer template is used, the same one as the rollout's; drop the key",
    "data.custom_cls": "the dataset is recipe.data.sft_dataset; drop the key",
    "data.balance_dp_token": "DP ranks get equal row counts; drop the key",
    "data.multiturn.enable_thinking_key": "not supported; drop the key",
    "model.strategy": "polyturn trains with Megatron only (megatron.*); drop the key",
    "model.fsdp_config": "polyturn trains with Megatron: use megatron.*",
    "model.lora_rank": "LoRA is not supported; drop the key",
    "model.enable_gradient_checkpointing": "not wired to Megatron's recompute yet; drop the key",
    "model.trust_remote_code": "models load through polyturn's HF <-> Megatron conversion (Qwen2 family); drop the key",
    "model.external_lib": "not supported; drop the key",
    "model.use_liger": "not supported; drop the key",
    "ulysses_sequence_parallel_size": "sequence parallelism is not supported; use megatron.tensor_model_parallel_size",
    "use_remove_padding": "micro-batches are cut to their own padding window; drop the key",
}


def _leaf_keys(d: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in d.items():
        keys.extend(_leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [prefix + k])
    return keys


def _refuse(key: str) -> None:
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        advice = UNSUPPORTED.get(".".join(parts[:i]))
        if advice is not None:
            raise ConfigError(f"not supported by polyturn: {key}; {advice}")


def check_overrides(overrides: list[str]) -> None:
    """Refuse `key=value` overrides naming a refused verl key (with what to use instead) or an unknown key (with the
    nearest known ones), before Hydra composes."""
    known = flat_keys(SFTConfig)
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k}
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra."):
            continue
        _refuse(key)
        if key not in known and key not in sections:
            near = difflib.get_close_matches(key, known, n=3)
            raise ConfigError(f"unknown config key {key!r}" + (f"; did you mean {near}?" if near else "") +
                              " The SFT keys are in recipe/config/sft_trainer.yaml")
