"""The memory plan of one GPU in hybrid placement, printed at start and checked before Ray starts.

In hybrid mode the Megatron ranks and an engine share every GPU and take turns (recipe.trainer): during the
rollout the engine holds its static memory (`rollout.gpu_memory_utilization` of the GPU: weights + KV cache)
next to whatever Megatron state is not offloaded; during training the engine has released its memory and every
role's state is back on the GPU. Sizes per GPU, from the HF config (N parameters) and each role's layout (its
TP x PP shards its model; its DP shards its distributed optimizer's state):

- params: N / (tp * pp) x 2 bytes in bf16 (4 in fp32), for each role (actor, reference, critic);
- gradient buffers: 4 bytes per parameter (fp32, reduced in fp32), actor and critic;
- optimizer: fp32 main params (bf16 only) + two fp32 Adam moments, divided by DP with the distributed optimizer;
- engine: weights N / rollout TP x its dtype's bytes; the KV cache gets the rest of its static share;
- weight sync (the engine's weights resumed, its KV cache not yet): the actor's parameters, back on the GPU when
  offloaded, and the senders' two buckets plus the largest tensor twice (gathered shards, then whole);
- checkpoint (the engine's whole share back): one role's parameters at a time, back on the GPU when offloaded;
- a fixed reserve per process on the GPU for the CUDA context and communication buffers (`CONTEXT_BYTES`).

Activations are not counted: the training phase's line says how much is left for them. A plan that cannot fit
is refused naming the keys to change. Where it departs from verl: verl has no such check; an OOM there shows up
minutes in, at the first rollout or update.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from recipe.config_schema import ConfigError, PPOConfig
from recipe.flops import ModelFlops
from recipe.placement import PlacementPlan

logger = logging.getLogger(__name__)

GIB = 1 << 30
CONTEXT_BYTES = 1 * GIB  # CUDA context, NCCL buffers, allocator slack: per process sharing the GPU
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
OFFLOAD_KEYS = ("actor_rollout_ref.actor.megatron.param_offload=true", "grad_offload=true", "optimizer_offload=true")


def parameter_count(hf_config: Any) -> int:
    """N: every layer's projections, the LM head and, when untied, the input embedding (norms are negligible)."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    n = ModelFlops.from_hf_config(c).matmul_params
    return n if c.get("tie_word_embeddings") else n + c["vocab_size"] * c["hidden_size"]


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one GPU, by what holds them."""

    gpu: int  # the GPU's memory
    params: int  # every role's parameter shards
    grads: int
    optimizer: int
    offloaded: int  # of params + grads + optimizer, what the *_offload keys move to the host between phases
    engine_static: int  # the engine's share: weights + KV cache
    engine_weights: int
    reserve: int  # CUDA contexts of the processes on the GPU
    sync_extra: int = 0  # during the weight sync, beyond the resident state: onloaded actor params, sender buffers
    onloaded_params: int = 0  # the largest trained role's offloaded params, back on the GPU to save a checkpoint

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def kv_cache(self) -> int:
        return self.engine_static - self.engine_weights

    @property
    def rollout_free(self) -> int:
        """Left during the rollout, after the engine's share, the resident Megatron state and the reserve."""
        return self.gpu - self.engine_static - (self.state - self.offloaded) - self.reserve

    @property
    def sync_free(self) -> int:
        """Left during the weight sync: the engine's weights, the resident state, what the sync brings, the reserve."""
        return self.gpu - self.engine_weights - (self.state - self.offloaded) - self.sync_extra - self.reserve

    @property
    def checkpoint_free(self) -> int:
        """Left while a checkpoint is written after a step: the rollout's share, less the parameters it brings back."""
        return self.rollout_free - self.onloaded_params

    @property
    def training_free(self) -> int:
        """Left for activations during training (the engine has released its memory)."""
        return self.gpu - self.state - self.reserve

    def describe(self) -> str:
        g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
        return (f"memory plan per GPU ({g(self.gpu)} GiB): Megatron params {g(self.params)} + grads {g(self.grads)} + "
                f"optimizer {g(self.optimizer)} GiB ({g(self.offloaded)} offloaded during the rollout); engine "
                f"{g(self.engine_static)} GiB = weights {g(self.engine_weights)} + KV cache {g(self.kv_cache)}; "
                f"reserve {g(self.reserve)} GiB; free: {g(self.rollout_free)} GiB in the rollout, "
                f"{g(self.sync_free)} GiB in the weight sync, {g(self.checkpoint_free)} GiB while saving a checkpoint, "
                f"{g(self.training_free)} GiB for activations in training")

    def check(self) -> None:
        """Raise ConfigError naming the keys to change when a phase cannot fit."""
        if self.kv_cache <= 0:
            raise ConfigError(
                f"the engine's share of the GPU (actor_rollout_ref.rollout.gpu_memory_utilization) holds "
                f"{self.engine_static / GIB:.1f} GiB but its weights alone take {self.engine_weights / GIB:.1f} GiB: "
                "no room for a KV cache; raise gpu_memory_utilization or "
                "actor_rollout_ref.rollout.tensor_model_parallel_size")
        if self.rollout_free < 0:
            raise ConfigError(
                f"the rollout does not fit: the engine's {self.engine_static / GIB:.1f} GiB next to "
                f"{(self.state - self.offloaded) / GIB:.1f} GiB of resident Megatron state exceed the GPU by "
                f"{-self.rollout_free / GIB:.1f} GiB; set {', '.join(OFFLOAD_KEYS)} or lower "
                "actor_rollout_ref.rollout.gpu_memory_utilization")
        if self.sync_free < 0:
            raise ConfigError(
                f"the weight sync does not fit: the engine's weights, the resident Megatron state and the sync's "
                f"{self.sync_extra / GIB:.1f} GiB (the actor's parameters and the sender's buckets) exceed the GPU by "
                f"{-self.sync_free / GIB:.1f} GiB; lower actor_rollout_ref.rollout.update_weights_bucket_megabytes or "
                "raise actor_rollout_ref.actor.megatron.tensor_model_parallel_size")
        if self.checkpoint_free < 0:
            raise ConfigError(
                f"saving a checkpoint does not fit: the engine's {self.engine_static / GIB:.1f} GiB, the resident Megatron "
                f"state and {self.onloaded_params / GIB:.1f} GiB of parameters back from the host exceed the GPU by "
                f"{-self.checkpoint_free / GIB:.1f} GiB; lower actor_rollout_ref.rollout.gpu_memory_utilization or "
                "raise actor_rollout_ref.actor.megatron.tensor_model_parallel_size")
        if self.training_free < 0:
            raise ConfigError(
                f"training does not fit: the Megatron state takes {self.state / GIB:.1f} GiB of the GPU's "
                f"{self.gpu / GIB:.1f} GiB; raise actor_rollout_ref.actor.megatron.tensor_model_parallel_size or "
                "pipeline_model_parallel_size, or set optim.use_distributed_optimizer=true")


def plan_memory(cfg: PPOConfig, plan: PlacementPlan, hf_config: Any, gpu_bytes: int) -> MemoryPlan:
    """The hybrid plan's bytes on one GPU of `gpu_bytes` (see the module docstring)."""
    m, rollout = cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.rollout
    params = grads = optimizer = 0.0
    role_params: dict[str, float] = {}  # the trained roles' (checkpointed) parameter bytes
    for name, role in cfg.workers().items():
        rm = role.megatron
        shard = parameter_count(hf_config) / (rm.tensor_model_parallel_size * rm.pipeline_model_parallel_size)
        params += shard * DTYPE_BYTES[rm.dtype]
        if role.optim is None:  # the reference: parameters only
            continue
        role_params[name] = shard * DTYPE_BYTES[rm.dtype]
        grads += shard * 4
        per_param = (4 if rm.dtype != "float32" else 0) + 8  # fp32 main params (bf16 only) + Adam moments
        optimizer += shard * per_param / (cfg.role_dp_size(role) if role.optim.use_distributed_optimizer else 1)
    offloaded = params * m.param_offload + grads * m.grad_offload + optimizer * m.optimizer_offload
    engine_bytes = DTYPE_BYTES[rollout.dtype]
    engine_weights = parameter_count(hf_config) * engine_bytes / rollout.tensor_model_parallel_size
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    sync_extra = role_params["actor"] * m.param_offload + 2 * (rollout.update_weights_bucket_megabytes << 20) \
        + 2 * c["vocab_size"] * c["hidden_size"] * engine_bytes
    return MemoryPlan(gpu=gpu_bytes, params=int(params), grads=int(grads), optimizer=int(optimizer),
                      offloaded=int(offloaded), engine_static=int(rollout.gpu_memory_utilization * gpu_bytes),
                      engine_weights=int(engine_weights), reserve=CONTEXT_BYTES * (len(plan.roles) + 1),
                      sync_extra=int(sync_extra), onloaded_params=int(max(role_params.values()) * m.param_offload))


def check_memory(cfg: PPOConfig, plan: PlacementPlan, hf_config: Any, gpu_bytes: int | None) -> MemoryPlan | None:
    """Log the plan of a hybrid run and refuse one that cannot fit; None (nothing to plan) in separate placement or
    when the GPU's size is unknown (`gpu_bytes` None: the driver sees no GPU)."""
    if not plan.hybrid or gpu_bytes is None:
        logger.info("memory plan: skipped (%s)", "separate placement" if not plan.hybrid else "no GPU on the driver")
        return None
    memory = plan_memory(cfg, plan, hf_config, gpu_bytes)
    logger.info(memory.describe())
    memory.check()
    return memory


def driver_gpu_bytes() -> int | None:
    """The memory of this process's first GPU (the cluster's GPUs are taken to be alike); None without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
