"""Weight sync, Megatron TP2 -> one SGLang engine, by each path: tensor, distributed, disk; bf16 and fp32 params.

    python -m benchmarks.weight_sync [--bucket-mb 512 --repeats 3 --layers 24 --memcpy-mb 1024] [--smoke]

The model has Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14/2 heads, ffn 4864, vocab 151936,
tied embeddings), randomly initialised and written as a bf16 HF checkpoint (no download). One
SGLang engine (TP=1, bf16) serves it. A Megatron TP=2 group on Ray (gloo on CPU; a reference-policy
role, no optimizer) holds it with bfloat16 parameters, then a second group with float32 parameters
(the engine dtype is bf16, so fp32 parameters are cast on the way): `recipe.weight_sync.WeightSync`
syncs each by each path: a first sync, then `--repeats` more whose median is reported per path (the disk
path includes writing the checkpoint). `tensor_first_s` / `distributed_first_s` are the first syncs, where
the senders still allocate (and their TP peers map) the bucket buffers they keep for later syncs, and the
distributed path makes its process group; `tensor_control_s` is the part of a tensor-path sync outside the
senders' export and shipping (closing the engine's weight-update session with the version and the cache
flush; median). A last tensor-path sync runs with the checksum check on, so the
figures are for syncs that are known to land. `peak_extra_mb` is the largest extra memory any sender
rank held during the live-path syncs (bucket buffers + the tensor being copied in, see
`megatron_workers.weights`); the goal is under two buckets.

Bandwidth: the same run times a `--memcpy-mb` tensor copy in this process (`memcpy_gbps`, the
machine's bound for moving bytes) and reports each live path's GB/s (engine bytes / seconds, 1 GB =
1e9 bytes) and its fraction of memcpy; and a `--memcpy-mb` / 2 gloo broadcast between two processes of this
host (`broadcast_gbps`, `broadcast_memcpy_fraction`): the distributed path's transport on CPUs, its bound here
(NCCL's on GPUs). Where the tensor path's time goes (bf16 parameters), each
part timed alone in the same run: `export_s` (the ranks' `stats` mode: TP gather, re-split to HF
layout, packing into buckets, nothing shipped; max over ranks), `serialize_s` and `engine_load_s`
(buckets of the checkpoint's own tensors built in this process, pickled by shared-memory name and
loaded by the engine actor's `load_payload`, which is what the senders call).

`--smoke`: a 2-layer model of hidden 64 with 1 MiB buckets and a 64 MiB copy, two syncs per path: the
same code path in seconds (the suite runs it; its figures mean nothing).

Last line: JSON with RESULT_KEYS (the un-prefixed figures are for bf16 parameters; `fp32_*` for fp32).
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from megatron_workers import cpu_compat

logger = logging.getLogger(__name__)

RESULT_KEYS = (
    "params", "bytes", "bucket_mb", "tensor_s", "distributed_s", "disk_s", "peak_extra_mb", "tensor_speedup",
    "distributed_speedup", "check_s", "memcpy_gbps", "tensor_gbps", "distributed_gbps", "tensor_memcpy_fraction",
    "distributed_memcpy_fraction", "tensor_first_s", "distributed_first_s", "tensor_control_s", "export_s",
    "export_wall_s", "serialize_s", "engine_load_s", "fp32_tensor_s", "fp32_distributed_s", "fp32_disk_s",
    "fp32_tensor_gbps", "fp32_distributed_gbps", "broadcast_gbps", "broadcast_memcpy_fraction",
)

QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
}
SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1024, "bos_token_id": 0, "eos_token_id": 1}


def write_random_checkpoint(out: Path, config: dict[str, Any]) -> int:
    """A random bf16 HF checkpoint of a Qwen2 `config` (e.g. QWEN2_5_0_5B); returns params."""
    from safetensors.torch import save_file

    from megatron_workers.adapters import hf_tensor_shapes

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in hf_tensor_shapes(config).items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.copy_(torch.randn(shape, generator=g) * 0.02)
        state[name] = t
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in state.values())


def memcpy_gbps(mb: int, repeats: int = 3) -> float:
    """GB/s of one `mb` MiB tensor copy in this process (median of `repeats`, after a warm-up copy)."""
    src = torch.ones(mb << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() / statistics.median(times[1:]) / 1e9


def _broadcast_rank(rank: int, port: int, mb: int, repeats: int, q: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(mb << 20, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, src=0)
        times.append(time.perf_counter() - t0)
    if rank == 1:  # the receiver: done when the bytes have arrived
        q.put(t.numel() / statistics.median(times[1:]) / 1e9)
    dist.destroy_process_group()


def broadcast_gbps(mb: int, repeats: int = 3) -> float:
    """GB/s of a gloo broadcast of `mb` MiB from one process to another on this host (median of `repeats`, after a
    warm-up broadcast)."""
    from megatron_workers.ports import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, mb, repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)


def time_paths(group: Any, engine: Any, args: argparse.Namespace, root: Path, version: int) -> dict[str, Any]:
    """Median seconds of each path for one actor group, its bytes and peak extra memory; then one checked sync."""
    from recipe.weight_sync import WeightSync

    out: dict[str, Any] = {}
    peaks, nbytes = [], 0.0
    for mode in ("tensor", "distributed", "disk"):
        sync = WeightSync(group, [engine], mode=mode, bucket_bytes=args.bucket_mb << 20,
                          engine_dtype="bfloat16", check=False, disk_dir=str(root / "disk"))
        times, control = [], []
        for _ in range(1 + args.repeats):
            version += 1
            m = sync.sync(version)
            times.append(m["weight_sync/seconds"])
            control.append(m["weight_sync/seconds"] - m["weight_sync/send_seconds"])
            if mode != "disk":
                peaks.append(m["weight_sync/peak_extra_mb"])
                nbytes = m["weight_sync/bytes"]
            logger.info("%s sync: %.2fs %s", mode, times[-1], m)
        sync.close()
        out[f"{mode}_s"] = statistics.median(times[1:])
        if mode != "disk":  # the first sync by a path: buffers allocated and mapped, the distributed path's groups made
            out[f"{mode}_first_s"] = times[0]
        if mode == "tensor":
            out["tensor_control_s"] = statistics.median(control[1:])
    checked = WeightSync(group, [engine], mode="tensor", bucket_bytes=args.bucket_mb << 20,
                         engine_dtype="bfloat16", check=True)
    out["check_s"] = checked.sync(version + 1)["weight_sync/check_seconds"]
    out.update(bytes=nbytes, peak_extra_mb=max(peaks), version=version + 1)
    return out


def profile_tensor_path(group: Any, engine: Any, model_dir: Path, bucket_bytes: int) -> dict[str, float]:
    """The tensor path's parts, each timed alone: the ranks' export (no shipping), pickling the buckets by
    shared-memory name, and the engine loading them (`load_payload`, as the senders call it)."""
    import ray
    from safetensors.torch import load_file

    from megatron_workers.sync_plan import SyncPlan
    from megatron_workers.shared_tensors import serialize
    from megatron_workers.weights import (
        BucketBuffers,
        MemoryMeter,
        bucket_by_bytes,
        stream_buckets,
    )

    stats_plan = SyncPlan(transport="none", bucket_bytes=bucket_bytes, dtype="bfloat16", checksums=False,
                          key="profile")
    t0 = time.perf_counter()
    sent = [r for r in group.send_weights(stats_plan) if r]
    export_wall = time.perf_counter() - t0
    state = load_file(str(model_dir / "model.safetensors"))  # the HF tensors the engine loads, bf16
    named = list(state.items())
    plan = list(bucket_by_bytes(named, bucket_bytes))
    serialize_s = load_s = 0.0
    engine.begin_weight_update()
    for b in stream_buckets(iter(named), plan, MemoryMeter(), BucketBuffers()):  # bucket k reuses k-2's buffer
        t0 = time.perf_counter()
        payload = serialize(b.named_tensors())
        serialize_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        ray.get(engine.handle.load_payload.remote(f"profile/bucket{b.index}", 0, payload))
        load_s += time.perf_counter() - t0
    engine.end_weight_update()  # the same weights as the last sync: the version stays
    return {"export_s": max(r["seconds"] for r in sent), "export_wall_s": export_wall,
            "serialize_s": serialize_s, "engine_load_s": load_s}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket size (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="syncs per path after the first (median reported)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24 = Qwen2.5-0.5B)")
    parser.add_argument("--memcpy-mb", type=int, default=1024, help="size of the reference tensor copy (MiB)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, two syncs per path: the code path in seconds")
    args = parser.parse_args(argv)
    config = dict(QWEN2_5_0_5B, num_hidden_layers=args.layers)
    if args.smoke:
        config = dict(QWEN2_5_0_5B, **SMOKE)
        args.bucket_mb, args.repeats, args.memcpy_mb = 1, 1, 64
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    cpu_compat.apply_cpu_compat()  # this process's start (it imports the Megatron worker classes)
    import ray

    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig, MegatronConfig
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout
    from rollout.engines.engine_actor import EngineClient

    memcpy = memcpy_gbps(args.memcpy_mb)
    logger.info("memcpy of %d MiB: %.2f GB/s", args.memcpy_mb, memcpy)
    broadcast = broadcast_gbps(args.memcpy_mb // 2)
    logger.info("gloo broadcast of %d MiB between two processes: %.2f GB/s", args.memcpy_mb // 2, broadcast)
    root = Path(tempfile.mkdtemp(prefix="polyturn-bench-wsync-"))
    params = write_random_checkpoint(root / "model", config)
    logger.info("random checkpoint: %d params at %s", params, root / "model")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(root / "ray"))
    engine = None
    figures: dict[str, dict[str, Any]] = {}
    try:
        engine = EngineClient.launch(str(root / "model"), name="bench-engine", ray_options={}, dtype="bfloat16",
                                     skip_tokenizer_init=True, max_total_tokens=1024, log_level="error")
        version = 0
        for dtype in ("bfloat16", "float32"):
            group = MegatronWorkerGroup(ParallelLayout(tp=2), seed=0)
            try:
                group.build(functools.partial(MegatronActor, str(root / "model"),
                                              ActorConfig(optim=None, megatron=MegatronConfig(
                                                  dtype=dtype, sequence_parallel=False))))  # SP: no part of a sync
                figures[dtype] = time_paths(group, engine, args, root, version)
                version = figures[dtype]["version"]
                if dtype == "bfloat16":
                    figures[dtype].update(profile_tensor_path(group, engine, root / "model", args.bucket_mb << 20))
            finally:
                group.shutdown()
    finally:
        if engine is not None:
            engine.shutdown()
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)  # the checkpoint and its disk-sync copy: ~3 GB at full size
    bf, fp = figures["bfloat16"], figures["float32"]
    gbps = {f"{m}_gbps": bf["bytes"] / bf[f"{m}_s"] / 1e9 for m in ("tensor", "distributed")}
    out = {
        "params": params, "bytes": int(bf["bytes"]), "bucket_mb": args.bucket_mb,
        **{k: bf[k] for k in ("tensor_s", "distributed_s", "disk_s", "peak_extra_mb")},
        "tensor_speedup": bf["disk_s"] / bf["tensor_s"], "distributed_speedup": bf["disk_s"] / bf["distributed_s"],
        "check_s": bf["check_s"], "memcpy_gbps": memcpy, **gbps,
        "tensor_memcpy_fraction": gbps["tensor_gbps"] / memcpy,
        "distributed_memcpy_fraction": gbps["distributed_gbps"] / memcpy,
        **{k: bf[k] for k in ("tensor_first_s", "distributed_first_s", "tensor_control_s", "export_s",
                              "export_wall_s", "serialize_s", "engine_load_s")},
        **{f"fp32_{m}_s": fp[f"{m}_s"] for m in ("tensor", "distributed", "disk")},
        **{f"fp32_{m}_gbps": fp["bytes"] / fp[f"{m}_s"] / 1e9 for m in ("tensor", "distributed")},
        "broadcast_gbps": broadcast, "broadcast_memcpy_fraction": broadcast / memcpy,
    }
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
