"""The SFT entry's typed config: `recipe/config/sft_trainer.yaml` (verl's fsdp_sft_trainer key names) as dataclasses.

SFT reuses the RL config's sections where the concept is the same, so every default is declared
once: `data.*` extends RL's `DataFiles`, `trainer.*` is RL's `RunConfig`, `model.*` extends the
roles' `ModelSection` (`enable_gradient_checkpointing`), `optim.*` and `megatron.*` are the actor's
Megatron sections, `ray_init.*` is RL's. The dataclasses' defaults are registered with Hydra as
`sft_trainer_schema` when the launch composes (`recipe.launch.compose`); `sft_trainer.yaml` holds only what SFT
sets differently. The command line
goes through the RL entry's machinery (`recipe.launch`, entry `SFT`): a verl fsdp_sft_trainer key
polyturn's SFT does not take is refused naming what to use instead (`SFT_VERL_KEYS`), a typo gets
"did you mean", all before Hydra composes and before Ray starts.

Where it departs from verl's `sft_trainer.yaml`: the model trains on Megatron ranks
(`megatron.*` sets the layout, `optim.*` is the RL actor's Megatron optimizer section, so
`optim.betas` / `warmup_steps_ratio` / `lr_scheduler` are `adam_beta1/2`, `lr_warmup_steps`,
`lr_decay_style` + `lr_decay_steps`), the data is multi-turn only, the seed is the top-level
`seed`, and the output is one HF directory at the end (no intermediate checkpoints).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_workers.config import MegatronConfig, OptimConfig
from recipe.config_build import ConfigError, build
from recipe.config_shared import DataFiles, ModelSection, RayInitConfig, RunConfig, is_hub_id, resolve_path
from recipe.data.sft_dataset import TRUNCATIONS
from recipe.launch import Entry, Rule


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
class SFTDataConfig(DataFiles):
    """`data.*`: demonstrations (RL's files and batch size) and how SFT batches and cuts them."""

    micro_batch_size_per_gpu: int = 4
    """Conversations per forward/backward on one rank (also the validation pass)."""
    max_length: int = 1024
    """Token budget of one conversation (prompt + every turn); longer ones follow data.truncation."""
    truncation: str = "error"
    """error: refuse a longer conversation naming its row; right: cut the end of its response."""
    multiturn: SFTMultiTurnConfig = field(default_factory=SFTMultiTurnConfig)
    """Column names."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("micro_batch_size_per_gpu", "max_length"):
            if getattr(self, key) < 1:
                raise ConfigError(f"data.{key} is {getattr(self, key)}; it must be >= 1")
        if self.truncation not in TRUNCATIONS:
            raise ConfigError(f"data.truncation={self.truncation!r}; use one of {TRUNCATIONS}")


@dataclass
class SFTModelConfig(ModelSection):
    """`model.*`: the checkpoint to start from, and how its Megatron model is built."""

    partial_pretrain: str | None = None
    """HF checkpoint directory (or a hub id, downloaded at start) whose tokenizer's chat template is the rollout's."""

    def __post_init__(self) -> None:
        if self.partial_pretrain is None:
            raise ConfigError("model.partial_pretrain is not set; give an HF checkpoint directory, e.g. "
                              "model.partial_pretrain=/models/Qwen2.5-0.5B-Instruct")
        if not is_hub_id(self.partial_pretrain):
            self.partial_pretrain = resolve_path(self.partial_pretrain, "model.partial_pretrain")


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
    trainer: RunConfig = field(default_factory=RunConfig)
    """`trainer.*` (the RL trainer's run section)."""
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
        if self.model.enable_gradient_checkpointing:
            m.recompute_activations()
        if self.data.train_batch_size % self.dp_size:
            raise ConfigError(f"data.train_batch_size={self.data.train_batch_size} cannot be split over {self.dp_size} "
                              "data-parallel ranks; make it a multiple of the DP size")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (ConfigError when megatron.* does not divide the trainer's ranks)."""
        return self.trainer.dp_size(self.megatron)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SFTConfig:
        """Build and validate from a plain nested dict (`OmegaConf.to_container(cfg, resolve=True)`)."""
        return build(cls, d)


_ONE_EXPORT = "SFT writes one HF directory, <trainer.default_local_dir>/hf, at the end; drop the key"
_NO_RESUME = "SFT does not resume; start a new run from an exported HF dir (model.partial_pretrain)"
_MULTI_TURN = "polyturn's SFT is multi-turn only: write rows as a messages column (data.multiturn.messages_key)"

# verl fsdp_sft_trainer keys that are not keys of SFTConfig (a key, or a section with everything under it).
SFT_VERL_KEYS: dict[str, Rule] = {
    "trainer.seed": Rule("the seed is the top-level key", rename="seed"),
    "trainer.save_freq": Rule(_ONE_EXPORT),
    "trainer.max_ckpt_to_keep": Rule(_ONE_EXPORT),
    "trainer.checkpoint": Rule(_ONE_EXPORT),
    "trainer.resume_path": Rule(_NO_RESUME),
    "trainer.resume_mode": Rule(_NO_RESUME),
    "trainer.default_hdfs_dir": Rule("outputs go to trainer.default_local_dir only; drop the key"),
    "trainer.device": Rule("the device follows the Ray cluster (GPUs when it has them); drop the key"),
    "optim.betas": Rule("use optim.adam_beta1 and optim.adam_beta2"),
    "optim.warmup_steps_ratio": Rule("use optim.lr_warmup_steps (optimizer steps)"),
    "optim.lr_scheduler": Rule("use optim.lr_decay_style (constant, linear, cosine, ...) with optim.lr_decay_steps"),
    "data.micro_batch_size": Rule("give the per-GPU size data.micro_batch_size_per_gpu"),
    **{f"data.{k}": Rule(_MULTI_TURN) for k in ("prompt_key", "response_key", "prompt_dict_keys",
                                                  "response_dict_keys")},
    "data.chat_template": Rule("the model directory's tokenizer template is used, the same one as the rollout's; "
                               "drop the key"),
    "data.custom_cls": Rule("the dataset is recipe.data.sft_dataset; drop the key"),
    "data.balance_dp_token": Rule("DP ranks get equal row counts; drop the key"),
    "data.multiturn.enable_thinking_key": Rule("not supported; drop the key"),
    "model.strategy": Rule("polyturn trains with Megatron only (megatron.*); drop the key"),
    "model.fsdp_config": Rule("an FSDP knob (polyturn trains with Megatron: megatron.*)", warn=True),
    "model.lora_rank": Rule("LoRA is not supported; drop the key", accept=(0,)),
    "model.trust_remote_code": Rule("models load through polyturn's HF <-> Megatron conversion (Qwen2 family); drop "
                                    "the key", accept=(False,)),
    "model.external_lib": Rule("not supported; drop the key", accept=(None,)),
    "model.use_liger": Rule("not supported; drop the key", accept=(False,)),
    "ulysses_sequence_parallel_size": Rule("sequence parallelism is not supported; use "
                                           "megatron.tensor_model_parallel_size", accept=(1,)),
    "use_remove_padding": Rule("micro-batches are cut to their own padding window", warn=True),
}

SFT = Entry(SFTConfig, "sft_trainer", ("sft_trainer",), SFT_VERL_KEYS, "recipe.main_sft")
"""The SFT entry point (`recipe.launch.load(argv, SFT)`)."""
