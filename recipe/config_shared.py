"""The config sections every entry point shares (RL's `PPOConfig`, SFT's `SFTConfig`): data files, how a model is
built, the run (length, resources, output, logging) and Ray, with the path helpers their checks use.

Declared once here, so RL and SFT cannot drift apart; `recipe.config_schema` and `recipe.sft_config` extend them.
Importing this module loads nothing heavy.
"""
from __future__ import annotations

import importlib.util

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipe.config_build import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
LOGGERS = ("console", "wandb", "tensorboard")


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
class DataFiles:
    """`data.*` of every entry point (RL and SFT): the files to train and validate on and the rows per step."""

    train_files: list[str] = field(default_factory=list)
    """Parquet files to train on, in verl's format: prompt rows for RL (python -m recipe.tasks.gsm8k writes them),
    a messages column (and an optional tools column) for SFT."""
    val_files: list[str] = field(default_factory=list)
    """Validation parquet files of the same format (RL rolls them out whole, SFT measures their loss); empty: no
    validation."""
    train_batch_size: int = 256
    """Rows per step over all data-parallel ranks: prompts (each rolled out `rollout.n` times) in RL, conversations
    per optimizer step in SFT."""

    def __post_init__(self) -> None:
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        if not self.train_files:
            raise ConfigError("data.train_files is empty; set it to the parquet file(s) to train on, e.g. "
                              "data.train_files=$HOME/data/gsm8k/train.parquet (python -m recipe.tasks.gsm8k makes them)")
        self.train_files = [resolve_path(f, "data.train_files") for f in self.train_files]
        if isinstance(self.val_files, str):
            self.val_files = [self.val_files]
        self.val_files = [resolve_path(f, "data.val_files") for f in self.val_files]
        if self.train_batch_size < 1:
            raise ConfigError(f"data.train_batch_size is {self.train_batch_size}; it must be >= 1")


@dataclass
class ModelSection:
    """`critic.model.*`, and the base of `actor_rollout_ref.model.*`: how a role's model is built (the critic's
    weights are the policy's checkpoint)."""

    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (verl's key): Megatron's full recompute,
    one layer per checkpoint; less memory, same result. A `recompute_*` field in this role's
    megatron.override_transformer_config wins over it."""


def is_hub_id(value: str) -> bool:
    """True for a hub model id ("Qwen/Qwen2.5-3B-Instruct") that is not also a local path."""
    return (not Path(value).expanduser().exists() and value.count("/") == 1
            and not value.startswith(("/", ".", "~")))


@dataclass
class RunConfig:
    """`trainer.*` of every entry point (RL and SFT): run length, resources, output and logging."""

    project_name: str = "polyturn"
    """Project name (wandb project)."""
    experiment_name: str = "gsm8k"
    """Run name (wandb run)."""
    logger: list[str] = field(default_factory=lambda: ["console", "wandb"])
    """Metric sinks, any of console, wandb, tensorboard (verl's `trainer.logger=console` means [console]);
    tensorboard writes under $TENSORBOARD_DIR, else <default_local_dir>/tensorboard."""
    total_training_steps: int | None = None
    """Steps to train; None: trainer.total_epochs passes over the training data."""
    total_epochs: int = 1
    """Passes over the training data (each reshuffled, seeded by the run's seed) when total_training_steps is None."""
    test_freq: int = -1
    """Validate every this many steps and after the last one (needs data.val_files); -1: never during training (SFT
    still measures the validation loss once, at the end)."""
    default_local_dir: str = "outputs/run"
    """Output directory: metrics.jsonl, wandb files, and what the run writes: checkpoints (`global_step_<k>/`) and the
    CPU preset's tiny model in RL, the trained model (`hf/`) in SFT."""
    n_gpus_per_node: int = 8
    """GPUs per node of the trainer pool: one placement bundle and one Megatron rank of each role per GPU
    (on a Ray cluster without GPUs, a CPU-share bundle each)."""
    nnodes: int = 1
    """Nodes of the trainer pool (recipe.placement); more than one: join a Ray cluster (RAY_ADDRESS)."""

    def __post_init__(self) -> None:
        unknown = [x for x in self.logger if x not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.logger has {unknown}; use a list of {LOGGERS}, e.g. trainer.logger=[console,wandb]")
        if "tensorboard" in self.logger and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(f"trainer.logger={self.logger} includes tensorboard, whose package is not installed "
                              "(torch.utils.tensorboard needs it): pip install tensorboard, or drop tensorboard from "
                              "trainer.logger")
        for key in ("total_training_steps", "total_epochs", "n_gpus_per_node", "nnodes"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key} is {getattr(self, key)}; it must be >= 1")
        if self.test_freq == 0 or self.test_freq < -1:
            raise ConfigError(f"trainer.test_freq is {self.test_freq}; use a step count >= 1, or -1 for no validation "
                              "during training")
        self.default_local_dir = str(Path(self.default_local_dir).expanduser().resolve())

    def dp_size(self, megatron: Any, section: str = "megatron") -> int:
        """Data-parallel ranks of a model split by `megatron` (its tensor x pipeline parallel sizes) over the
        trainer's ranks; ConfigError naming `section` when that split does not divide them."""
        world = self.n_gpus_per_node * self.nnodes
        mp = megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size
        if world % mp:
            raise ConfigError(f"trainer.n_gpus_per_node * trainer.nnodes = {world} ranks is not a multiple of tensor x "
                              f"pipeline parallel size = {mp} ({section}); change {section}.* or the rank count")
        return world // mp


@dataclass
class RayInitConfig:
    """`ray_init.*`: the local Ray cluster."""

    num_cpus: int | None = None
    """CPUs Ray may use; None: all of this machine's."""
    temp_dir: str | None = None
    """Ray's session directory; None: Ray's default (or $RAY_TMPDIR)."""
