"""What a Megatron rank (actor, reference, critic) is configured with: plain dataclasses, no Megatron import.

These are the config sections themselves: `recipe.config_schema` uses them (subclassed with the
trainer's and the losses' keys) as `actor_rollout_ref.actor.*` and `critic.*`, and the ranks
receive those sections as they are. Field names are verl's. A `ValueError` names the key
relative to its section; the config loader prefixes the section's dotted path.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

DTYPES = ("bfloat16", "float32")
# Megatron's activation recompute as verl's `enable_gradient_checkpointing` asks for it: only each layer's input is
# kept, and the layer is recomputed in the backward pass.
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


@dataclass
class OptimConfig:
    """`*.optim.*`: Megatron's Adam and OptimizerParamScheduler."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the LR decay."""
    lr_warmup_init: float = 0.0
    """Learning rate at step 0 of the warm-up."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_decay_steps: int = 1_000_000
    """Optimizer steps over which the LR decays to min_lr."""
    lr_decay_style: str = "constant"
    """One of constant, linear, cosine, inverse-square-root, WSD."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""
    clip_grad: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    use_distributed_optimizer: bool = True
    """Megatron's distributed optimizer: Adam moments and fp32 main params sharded over the DP ranks (ZeRO-1),
    gradients reduce-scattered, parameters all-gathered; False keeps a full copy on every DP rank."""

    def __post_init__(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style is {self.lr_decay_style!r}; use one of {LR_DECAY_STYLES}")
        for key in ("lr", "min_lr", "lr_warmup_init", "lr_warmup_steps", "weight_decay", "clip_grad"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} is {getattr(self, key)}; it must be >= 0")
        if self.lr_decay_steps < 1:
            raise ValueError(f"lr_decay_steps is {self.lr_decay_steps}; it must be >= 1")


@dataclass
class MegatronConfig:
    """`actor_rollout_ref.actor.megatron.*`: the model-parallel layout (data parallelism fills the other ranks)."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's weights (Megatron TP)."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the layers into stages (Megatron PP)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (Megatron's virtual pipeline stages, verl's key): rank r holds every PP-th
    slice of layers and Megatron's interleaved schedule runs them, for a smaller pipeline bubble. Needs
    pipeline_model_parallel_size > 1 and layers divisible by PP x this. None or 1: one chunk per rank."""
    param_offload: bool = False
    """Keep the parameters in CPU memory outside the training phase (colocated engines get the GPU memory)."""
    grad_offload: bool = False
    """Keep the gradient buffers in CPU memory outside the training phase."""
    optimizer_offload: bool = False
    """Keep the optimizer states in CPU memory outside the training phase."""
    dtype: str = "bfloat16"
    """Parameter and activation dtype (verl's key): bfloat16 (mixed precision: fp32 main params, Adam moments and
    gradient reduction in the optimizer; log-softmax, log-probs and losses in fp32) or float32."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism (verl's key and default): outside the attention and MLP blocks each TP rank keeps
    only its slice of the sequence (less activation memory; all-gather / reduce-scatter in place of all-reduce).
    Applies when tensor_model_parallel_size > 1 (with one TP rank there is nothing to split)."""
    override_transformer_config: dict = field(default_factory=dict)
    """Megatron TransformerConfig fields passed through as they are (verl's key), e.g. activation recompute:
    {recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 1} (granularity full alone gets
    that method and layer count); an unknown field is refused."""

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} is {getattr(self, key)}; it must be >= 1")
        if self.virtual_pipeline_model_parallel_size is not None and self.virtual_pipeline_model_parallel_size < 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size is {self.virtual_pipeline_model_parallel_size}; "
                             "it must be >= 1 (or null)")
        if self.vpp > 1 and self.pipeline_model_parallel_size == 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size is {self.vpp}: virtual stages split pipeline "
                             "stages; set pipeline_model_parallel_size > 1, or drop the key")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype is {self.dtype!r}; use one of {DTYPES}")
        if self.override_transformer_config:
            import dataclasses

            from megatron.core.transformer.transformer_config import TransformerConfig  # only when overrides are given

            known = {f.name for f in dataclasses.fields(TransformerConfig)}
            unknown = sorted(set(self.override_transformer_config) - known)
            if unknown:
                raise ValueError(f"override_transformer_config.{unknown[0]} is not a field of Megatron's "
                                 f"TransformerConfig; see megatron/core/transformer/transformer_config.py")
        impl = self.override_transformer_config.get("transformer_impl", "local")
        if impl not in ("local", "transformer_engine"):
            raise ValueError(f"override_transformer_config.transformer_impl={impl!r}; use local (the default) or "
                             "transformer_engine")
        if impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
            raise ValueError("override_transformer_config.transformer_impl=transformer_engine needs TransformerEngine, "
                             "which is not installed; install a build for this torch and CUDA, or drop the key")
        if self.override_transformer_config.get("recompute_granularity") == "full":
            self.recompute_activations()  # Megatron's full recompute needs a method and a layer count: fill them

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (virtual_pipeline_model_parallel_size, 1 when unset)."""
        return self.virtual_pipeline_model_parallel_size or 1

    def recompute_activations(self) -> None:
        """Turn on Megatron's full activation recompute (`FULL_RECOMPUTE`) under what override_transformer_config
        sets: its `recompute_*` fields win, and recompute_granularity=selective is left as it is."""
        if self.override_transformer_config.get("recompute_granularity", "full") == "full":
            self.override_transformer_config = {**FULL_RECOMPUTE, **self.override_transformer_config}


@dataclass
class WorkerConfig:
    """How a rank batches and trains (actor, reference and critic alike); sizes per rank unless said otherwise."""

    optim: OptimConfig | None = field(default_factory=OptimConfig)
    """Optimizer and LR schedule; None builds a forward-only rank (the reference policy)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout, dtype and offload of this role's ranks."""
    ppo_mini_batch_size: int = 64
    """Prompts per optimizer step, before x rollout.n (verl's meaning); the trainer splits the batch by it."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank; also sizes the log-prob and value passes."""
    use_dynamic_bsz: bool = True
    """Cut micro-batches by real-token count (ppo_max_token_len_per_gpu) instead of a fixed row count. verl's
    default is False; here it is True because sequences are packed without padding, so a token budget is what
    bounds a micro-batch's memory and work (losses are exact for any cut; see runner.py)."""
    ppo_max_token_len_per_gpu: int = 16384
    """Real tokens (prompt + response, no padding) of one dynamic micro-batch; a longer single sequence gets its own."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Samples per forward-only pass (log-probs, values) on one rank; None: ppo_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Pack forward-only micro-batches by token count; None: use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget of one dynamic forward-only micro-batch; None: ppo_max_token_len_per_gpu."""

    def __post_init__(self) -> None:
        for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "ppo_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} is {getattr(self, key)}; it must be >= 1")
        for key in ("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key} is {getattr(self, key)}; it must be >= 1 (or null)")


@dataclass
class ActorConfig(WorkerConfig):
    """A policy (or reference) rank's config: a WorkerConfig, under `actor_rollout_ref.actor.*`."""
