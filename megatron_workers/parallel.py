"""Process groups for one Megatron-Core rank, and the check that a model fits a TP x PP layout.

`validate_layout` runs in the driver, before any process starts, so that a layout the model
cannot take (TP not dividing the attention heads, PP not dividing the layers, ...) is refused
with the field and the fix instead of failing in every worker. `init_distributed` is what each
rank calls first: torch.distributed (the backend the CPU adapter answered), Megatron's model-parallel
groups, and its RNG tracker.

Departure from Megatron-LM's `initialize_megatron`: no argument namespace, no data parallel
configuration (data parallel size is whatever world_size / (TP * PP) leaves), and the RNG tracker
is Megatron's inference tracker: RL policies here run with dropout 0, so the per-TP-rank dropout
states the training tracker keeps are not needed (and it needs CUDA RNG states).
"""
from __future__ import annotations

import datetime
import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel

from megatron_workers.adapters import read_decoder_shape

logger = logging.getLogger(__name__)


def validate_layout(hf_config: Any | Mapping[str, Any], tp: int, pp: int, vpp: int = 1) -> None:
    """Refuse a TP x PP (x virtual pipeline stages per rank) layout the model cannot take; raises ValueError naming
    each field and fix.

    Also refuses an unsupported architecture (see `adapters.read_decoder_shape`).
    """
    shape = read_decoder_shape(hf_config)
    problems: list[str] = []
    if tp < 1 or pp < 1 or vpp < 1:
        problems.append(f"tp={tp}, pp={pp}, vpp={vpp}: each must be >= 1")
    else:
        for field, value in (
            ("num_attention_heads", shape.num_heads),
            ("num_key_value_heads", shape.num_kv_heads),
            ("intermediate_size", shape.ffn_hidden_size),
            ("vocab_size", shape.vocab_size),
        ):
            if value % tp:
                problems.append(
                    f"{field}={value} is not divisible by tp={tp}; "
                    f"choose a tensor parallel size that divides {value}"
                )
        if shape.num_layers % pp:
            problems.append(
                f"num_hidden_layers={shape.num_layers} is not divisible by pp={pp}; "
                f"choose a pipeline parallel size that divides {shape.num_layers}"
            )
        elif shape.num_layers % (pp * vpp):
            problems.append(
                f"num_hidden_layers={shape.num_layers} is not divisible by pp * vpp={pp * vpp}; choose a "
                f"virtual_pipeline_model_parallel_size that divides {shape.num_layers // pp} (the layers per stage)"
            )
        if vpp > 1 and pp == 1:
            problems.append(f"vpp={vpp} needs pipeline stages: set pipeline_model_parallel_size > 1, or vpp to 1")
    if problems:
        raise ValueError(f"model does not fit tp={tp}, pp={pp}, vpp={vpp}: " + "; ".join(problems))


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    tp: int,
    pp: int,
    backend: str = "nccl",
    vpp: int = 1,
    seed: int = 1234,
    timeout_minutes: int = 30,
) -> None:
    """Initialise torch.distributed and Megatron's TP/PP/DP groups for this rank.

    backend: the torch.distributed backend, as `cpu_compat.apply_cpu_compat()` answered at the
    process's start ("nccl", which also binds the rank to a local GPU, or "gloo"). world_size must
    be a multiple of tp * pp (the rest is data parallel). `vpp` > 1: each pipeline rank holds that many model
    chunks, run by Megatron's interleaved schedule (`build_gpt_model(vp_stage=...)`). Seeds torch and Megatron's RNG tracker
    with `seed`.
    """
    if world_size % (tp * pp):
        raise ValueError(
            f"world_size={world_size} is not a multiple of tp*pp={tp * pp}; "
            "start tp*pp*dp processes"
        )
    if backend == "nccl":  # NCCL works on the process's current CUDA device
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        distributed_timeout_minutes=timeout_minutes,
    )
    random.seed(seed)  # every RNG a checkpoint holds starts from the seed, so two runs' checkpoints compare
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    logger.info(
        "rank %d/%d: tp_rank=%d pp_rank=%d (%s)",
        rank,
        world_size,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        backend,
    )


def destroy() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
