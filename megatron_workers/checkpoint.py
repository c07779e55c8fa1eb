"""Save / resume a Megatron worker group, and export to an HF checkpoint directory.

Resume checkpoints are per rank: `DIR/rank_{r:05d}.pt` holds global rank `r`'s model shard
(GPTModel state dict; one per model chunk under virtual pipeline stages), optimizer state (Megatron's
optimizer `state_dict`), LR scheduler, RNG states (python, numpy, torch CPU, CUDA when present,
Megatron's RNG tracker) and the step; `DIR/meta.json` (written by rank 0) records the layout and the step. Every rank
writes its own file, so a save costs one write per rank.

With the distributed optimizer, `state_dict` holds only the hyper-parameters and the step:
the fp32 main parameters and the Adam state (both moments, step) live in DP shards. Each rank
saves its own shard in its file, in Megatron's bucket-space layout
(`get_parameter_state_dp_reshardable`, read back by `load_parameter_state_from_dp_reshardable`),
so a save needs no gather. (Megatron's gathering `save_parameter_state` / `load_parameter_state`
cannot restore torch Adam's per-parameter `step` in megatron-core 0.16.1: a KeyError.)

Where it departs from Megatron-LM's `dist_checkpointing`: no resharding. A resume
checkpoint loads into the *same* TP x PP x DP layout (checked, with a clear error). To
change the layout, export to HF (`export_hf`) and build a new group from it; that carries
the weights, not the optimizer moments. `export_hf` gathers the full state dict on global
rank 0 and writes `config.json`, `model.safetensors` and the tokenizer files of the source
checkpoint, which transformers' `from_pretrained` and SGLang's `Engine` load.
"""
from __future__ import annotations

import copy

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from megatron_workers import model as mmodel

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "chat_template.jinja", "generation_config.json", "tokenizer.model",
)
HF_DIR = "huggingface"  # in a resume checkpoint dir: the model's config.json and tokenizer (verl's name)


def _layout(optimizer: Any) -> dict[str, int | bool]:
    return {
        "world_size": torch.distributed.get_world_size(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "dp": mpu.get_data_parallel_world_size(),
        "vpp": mpu.get_virtual_pipeline_model_parallel_world_size() or 1,
        "distributed_optimizer": _distributed(optimizer),
    }


_LAYOUT_DEFAULTS = {"distributed_optimizer": False, "vpp": 1}  # what a checkpoint that does not record them had


def model_keys(chunks: int) -> list[str]:
    """Where each of a rank's `chunks` model chunks keeps its state dict in the rank file: "model", or "model0",
    "model1"... under virtual pipeline stages (Megatron-LM's names)."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank_{rank:05d}.pt"


def _distributed(optimizer: Any) -> bool:
    return optimizer is not None and optimizer.config.use_distributed_optimizer


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _sharded_param_state(optimizer: Any) -> list[dict[Any, Any]]:
    """This rank's distributed-optimizer shards (main params, exp_avg, exp_avg_sq, step), copied out of the
    live buffers, one bucket-space dict per sub-optimizer."""
    states = []
    for opt in _sub_optimizers(optimizer):
        state = opt.get_parameter_state_dp_reshardable()
        for gbuf, by_dtype in state.items():
            if not isinstance(gbuf, int):  # per_bucket_numel metadata
                continue
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for i, entry in enumerate(bucket):
                        # the loader skips entries flagged as padding; every entry here is a parameter
                        bucket[i] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in entry.items()}
                        bucket[i]["padding"] = False
        states.append(state)
    return states


def _load_sharded_param_state(optimizer: Any, states: list[dict[Any, Any]]) -> None:
    subs = _sub_optimizers(optimizer)
    if len(states) != len(subs):
        raise ValueError(f"the checkpoint holds {len(states)} distributed-optimizer states, this optimizer has {len(subs)}")
    with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
        for opt, state in zip(subs, states):
            # DistributedOptimizer.load_state_dict gives every parameter the SAME `step` tensor, which torch's Adam
            # then increments once per parameter per step (megatron-core 0.16.1): one tensor each, as before a save
            for param_state in opt.optimizer.state.values():
                if "step" in param_state:
                    param_state["step"] = param_state["step"].clone()
            opt.load_parameter_state_from_dp_reshardable(state)


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as a picklable dict."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(),
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def save_rank(path: str | Path, modules: list[torch.nn.Module], optimizer: Any, scheduler: Any, step: int) -> None:
    """Write this rank's resume file for its model chunks (collective: every rank calls it; returns after all
    wrote)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank()
    state = {
        "layout": _layout(optimizer),
        "coords": (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(), mpu.get_data_parallel_rank()),
        "step": step,
        **{key: m.state_dict() for key, m in zip(model_keys(len(modules)), modules)},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "optimizer_shards": _sharded_param_state(optimizer) if _distributed(optimizer) else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_state(),
    }
    tmp = _rank_file(path, rank).with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(_rank_file(path, rank))
    torch.distributed.barrier()
    if rank == 0:
        (path / "meta.json").write_text(json.dumps({**_layout(optimizer), "step": step}, indent=2))
    torch.distributed.barrier()
    logger.info("rank %d saved step %d to %s", rank, step, path)


def load_rank(path: str | Path, modules: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> int:
    """Restore this rank's model, optimizer, scheduler and RNG from `save_rank`'s files; returns the step.

    Refuses a checkpoint written with another layout (the files are per-rank shards).
    """
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} not found: {path} is not a complete polyturn resume checkpoint")
    meta = json.loads(meta_file.read_text())
    here = _layout(optimizer)
    saved = {k: meta.get(k, _LAYOUT_DEFAULTS.get(k)) for k in here}
    if saved != here:
        raise ValueError(
            f"checkpoint {path} was saved with layout {saved} but this group is {here}; resume with the "
            "same tp/pp/dp/vpp and optim.use_distributed_optimizer, or export_hf and start a new group from the HF "
            "checkpoint"
        )
    rank = torch.distributed.get_rank()
    state = torch.load(_rank_file(path, rank), map_location="cpu", weights_only=False)
    for key, m in zip(model_keys(len(modules)), modules):
        m.load_state_dict(state[key], strict=True)
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError(f"checkpoint {path} holds no optimizer state (saved by a reference worker)")
        optimizer.load_state_dict(state["optimizer"])
        if _distributed(optimizer):  # main params and Adam state of this rank's DP shard
            _load_sharded_param_state(optimizer, state["optimizer_shards"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    torch.distributed.barrier()
    return int(state["step"])


def export_hf(path: str | Path, modules: list[torch.nn.Module], hf_config: Any, source_dir: Optional[str | Path],
              dtype: torch.dtype) -> None:
    """Write an HF checkpoint dir from the sharded model in `dtype` (collective; rank 0 writes).

    `config.json` comes from `hf_config` (its `dtype` set to `dtype`), `model.safetensors` from the gathered
    weights cast to `dtype`, and the tokenizer files present in `source_dir` are copied alongside.
    """
    from safetensors.torch import save_file

    state = mmodel.export_hf_state_dict(modules, hf_config, dst_rank=0)
    if state is not None:
        path = Path(path)
        hf_config = copy.deepcopy(hf_config)
        hf_config.dtype = dtype
        save_hf_files(path, hf_config, source_dir)
        save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
        logger.info("exported %d tensors to %s (%s)", len(state), path, dtype)
    torch.distributed.barrier()


def save_hf_files(path: str | Path, hf_config: Any, source_dir: Optional[str | Path]) -> None:
    """`config.json` from `hf_config` and the tokenizer files present in `source_dir` (if any) into `path`:
    everything of an HF checkpoint dir but the weights (a resume checkpoint keeps them in `HF_DIR`, so that
    `python -m recipe.export_hf` needs nothing else)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(path)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(source_dir) / name
            if src.is_file():
                shutil.copy2(src, path / name)
