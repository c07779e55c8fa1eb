"""Weight sync, Megatron TP2 -> one SGLang engine, by each path: tensor, distributed, disk.

    python -m benchmarks.weight_sync [--bucket-mb 512 --repeats 2 --layers 24]

The model has Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14/2 heads, ffn 4864, vocab 151936,
tied embeddings), randomly initialised and written as a bf16 HF checkpoint (no download). A
Megatron TP=2 group on Ray (gloo on CPU) holds it (fp32 parameters; a reference-policy role, no
optimizer), one SGLang engine (TP=1, bf16) serves it, and `recipe.weight_sync.WeightSync` syncs
it by each path: the median of `--repeats` syncs is reported per path (the disk path includes
writing the checkpoint). A last tensor-path sync runs with the checksum check on, so the
figures are for syncs that are known to land. `peak_extra_mb` is the largest extra memory
any sender rank held during the live-path syncs (bucket buffers + the tensor being copied in,
see `megatron_workers.weights`); the goal is under two buckets.

Last line: JSON `{"params", "bytes", "tensor_s", "distributed_s", "disk_s", "peak_extra_mb", ...}`.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import tempfile
from pathlib import Path

import torch

from megatron_workers import cpu_compat

logger = logging.getLogger(__name__)

QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
}


def write_random_checkpoint(out: Path, layers: int) -> int:
    """A random bf16 HF checkpoint with Qwen2.5-0.5B's shapes (`layers` decoder layers); returns params."""
    from safetensors.torch import save_file

    from megatron_workers.adapters import hf_tensor_shapes

    config = dict(QWEN2_5_0_5B, num_hidden_layers=layers)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket size (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="syncs per path (median reported)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24 = Qwen2.5-0.5B)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    cpu_compat.apply_cpu_compat()  # this process's start (it imports the Megatron worker classes)
    import ray

    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout
    from recipe.weight_sync import WeightSync
    from rollout.engines.engine_actor import EngineClient

    root = Path(tempfile.mkdtemp(prefix="polyturn-bench-wsync-"))
    params = write_random_checkpoint(root / "model", args.layers)
    logger.info("random checkpoint: %d params at %s", params, root / "model")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(root / "ray"))
    group = engine = None
    try:
        group = MegatronWorkerGroup(ParallelLayout(tp=2), seed=0)
        group.build(functools.partial(MegatronActor, str(root / "model"), ActorConfig(optim=None)))
        engine = EngineClient.launch(str(root / "model"), name="bench-engine", ray_options={}, dtype="bfloat16",
                                     skip_tokenizer_init=True, max_total_tokens=1024, log_level="error")
        results: dict[str, float] = {}
        peaks, nbytes = [], 0.0
        version = 0
        for mode in ("tensor", "distributed", "disk"):
            sync = WeightSync(group, [engine], mode=mode, bucket_bytes=args.bucket_mb << 20,
                              engine_dtype="bfloat16", check=False, disk_dir=str(root / "disk"))
            times = []
            for _ in range(args.repeats):
                version += 1
                m = sync.sync(version)
                times.append(m["weight_sync/seconds"])
                if mode != "disk":
                    peaks.append(m["weight_sync/peak_extra_mb"])
                    nbytes = m["weight_sync/bytes"]
                logger.info("%s sync: %.2fs %s", mode, times[-1], m)
            sync.close()
            results[f"{mode}_s"] = statistics.median(times)
        checked = WeightSync(group, [engine], mode="tensor", bucket_bytes=args.bucket_mb << 20,
                             engine_dtype="bfloat16", check=True)
        m = checked.sync(version + 1)
        out = {
            "params": params, "bytes": int(nbytes), **{k: round(v, 3) for k, v in results.items()},
            "peak_extra_mb": round(max(peaks), 1), "bucket_mb": args.bucket_mb,
            "tensor_speedup": round(results["disk_s"] / results["tensor_s"], 2),
            "distributed_speedup": round(results["disk_s"] / results["distributed_s"], 2),
            "check_s": round(m["weight_sync/check_seconds"], 3),
        }
        print(json.dumps(out))
    finally:
        if engine is not None:
            engine.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
