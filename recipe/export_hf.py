"""Export a trainer checkpoint to an HF directory that transformers and SGLang load.

    python -m recipe.export_hf <checkpoint> <out dir> [--hf-source DIR] [--dtype bfloat16|float32]

`<checkpoint>` is a `global_step_<k>` directory, or a run's `trainer.default_local_dir` (then the newest
complete checkpoint, the one its `latest_checkpointed_iteration.txt` names). The actor's shards, saved in the
run's TP x PP x DP layout (megatron_workers.checkpoint), are loaded into TP x PP fresh Megatron ranks (one
spawned process each, gloo on a CPU machine); data-parallel ranks hold identical weights, so DP rank 0's shards
are the ones read. The ranks then write the export with the same conversion the actor's own `export_hf` and the
weight sync use (megatron_workers.model): `config.json`, `model.safetensors` (in `--dtype`, default bfloat16)
and the tokenizer files. Config and tokenizer come from the checkpoint's `actor/huggingface/` (the actor saves
them there), or from `--hf-source` (the run's `actor_rollout_ref.model.path`) for a checkpoint without them.

The last stdout line is JSON: {"checkpoint", "step" (the trainer's), "out", "tp", "pp", "dp", "tensors", "dtype"}.

Where it departs from verl's model merger: there is no second converter (no name mapping of its own), and the
optimizer state is not read, only each shard's model weights (memory-mapped).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from megatron_workers import cpu_compat
from megatron_workers.ports import free_port
from recipe import checkpoint

logger = logging.getLogger(__name__)

ACTOR = "actor"
HF_DIR = "huggingface"  # = megatron_workers.checkpoint.HF_DIR (not imported here: that module loads Megatron)


@dataclass(frozen=True)
class ActorShards:
    """One checkpoint's actor: its layout and, per (tp rank, pp rank), the rank file holding DP rank 0's weights."""

    directory: Path  # <global_step_k>/actor
    tp: int
    pp: int
    dp: int
    vpp: int  # model chunks per pipeline rank
    files: dict[tuple[int, int], Path]


def find_checkpoint(path: str | Path) -> Path:
    """The `global_step_<k>` directory `path` names: itself, or the newest complete one under a run directory."""
    path = Path(path)
    if (path / ACTOR).is_dir():
        return path
    step = checkpoint.latest_step(path)
    if step is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (no {ACTOR}/ inside) nor a run directory with a "
                                f"{checkpoint.MARKER}; give <trainer.default_local_dir>/global_step_<k> or "
                                "<trainer.default_local_dir>")
    found = checkpoint.step_dir(path, step)
    if not (found / ACTOR).is_dir():
        raise FileNotFoundError(f"{path / checkpoint.MARKER} names step {step} but {found / ACTOR} is missing")
    return found


def actor_shards(ckpt: Path) -> ActorShards:
    """Read the layout (`meta.json`) and find, for each TP x PP coordinate, the rank file of DP rank 0 (each rank
    file records its (tp, pp, dp) coordinates)."""
    directory = ckpt / ACTOR
    meta_file = directory / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} not found: {ckpt} is not a complete checkpoint (a save that did not "
                                "finish); export another global_step_<k>")
    meta = json.loads(meta_file.read_text())
    files = {}
    for f in sorted(directory.glob("rank_*.pt")):
        tp_rank, pp_rank, dp_rank = torch.load(f, map_location="cpu", mmap=True, weights_only=False)["coords"]
        if dp_rank == 0:
            files[(tp_rank, pp_rank)] = f
    missing = [(t, p) for t in range(meta["tp"]) for p in range(meta["pp"]) if (t, p) not in files]
    if missing:
        raise FileNotFoundError(f"{directory} has no DP-rank-0 shard for (tp rank, pp rank) {missing} of its "
                                f"tp={meta['tp']} x pp={meta['pp']} layout; the checkpoint is incomplete")
    return ActorShards(directory, meta["tp"], meta["pp"], meta["dp"], meta.get("vpp", 1), files)


def hf_source(ckpt: Path, given: str | Path | None) -> Path:
    """Where config.json and the tokenizer come from: `given`, else the checkpoint's own copy."""
    source = Path(given) if given is not None else ckpt / ACTOR / HF_DIR
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}/config.json not found: the checkpoint holds no model config; pass "
                                "--hf-source <the run's actor_rollout_ref.model.path>")
    return source


def _rank(rank: int, world_size: int, port: int, shards: ActorShards, source: str, out: str, dtype: str) -> None:
    """One Megatron rank: build the model stage (its chunks), load DP rank 0's weights for this (tp, pp), export (rank 0
    writes)."""
    backend = cpu_compat.apply_cpu_compat()  # this spawned process's start, before megatron is imported
    from megatron.core import parallel_state as mpu
    from transformers import AutoConfig

    from megatron_workers import checkpoint as mckpt, model as mmodel, parallel

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    hf_config = AutoConfig.from_pretrained(source)
    parallel.init_distributed(rank, world_size, "127.0.0.1", port, shards.tp, shards.pp, backend=backend,
                              vpp=shards.vpp, timeout_minutes=30)
    try:
        chunks = [mmodel.build_gpt_model(hf_config, vp_stage=v if shards.vpp > 1 else None) for v in range(shards.vpp)]
        coords = (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank())
        state = torch.load(shards.files[coords], map_location="cpu", mmap=True, weights_only=False)
        for key, chunk in zip(mckpt.model_keys(len(chunks)), chunks):
            chunk.load_state_dict(state[key], strict=True)
        del state
        mckpt.export_hf(out, chunks, hf_config, source, getattr(torch, dtype))
    finally:
        parallel.destroy()


def export(checkpoint_path: str | Path, out: str | Path, hf_source_dir: str | Path | None = None,
           dtype: str = "bfloat16") -> dict:
    """Export the actor of `checkpoint_path` (see the module docstring) into `out` with weights in `dtype`
    ("bfloat16" or "float32"; the shards load into fp32 ranks, so either is exact up to the cast); returns the
    summary line's dict."""
    ckpt = find_checkpoint(checkpoint_path)
    step = checkpoint.TrainerState.read(ckpt).step
    shards = actor_shards(ckpt)
    source = hf_source(ckpt, hf_source_dir)
    out = Path(out).resolve()
    world_size = shards.tp * shards.pp
    mp.spawn(_rank, args=(world_size, free_port(), shards, str(source), str(out), dtype), nprocs=world_size, join=True)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        tensors = len(f.keys())
    return {"checkpoint": str(ckpt), "step": step, "out": str(out), "tp": shards.tp, "pp": shards.pp, "dp": shards.dp,
            "tensors": tensors, "dtype": dtype}


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit status (0 exported, 2 could not export)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a global_step_<k> directory, or trainer.default_local_dir (newest)")
    parser.add_argument("out", help="the HF directory to write")
    parser.add_argument("--hf-source", default=None,
                        help="config + tokenizer source for a checkpoint without actor/huggingface/ (the run's "
                             "actor_rollout_ref.model.path)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="dtype of the written weights (default bfloat16)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        summary = export(args.checkpoint, args.out, args.hf_source, args.dtype)
    except (FileNotFoundError, ValueError, mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        logger.error("export failed: %s", exc)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
