"""One Megatron actor update vs one plain PyTorch update of the same model on the same batch.

    python -m benchmarks.train_step [--layers 4 --hidden 256 --batch 16 --seq 256 --repeats 5] [--smoke]

Both sides run the same step on CPU in fp32: masked token-mean cross-entropy over the
response tokens of a padded batch (`update_sft`, the same forward/backward/clip/Adam path as
`update_policy`), gradient clipping at 1.0, Adam. The Megatron side is a TP=1, PP=1 worker
group on Ray (one rank, gloo), timed from the driver, so it includes dispatch (pickling the
batch to the actor) and the finite-gradient check. The PyTorch side is a transformers model
and `torch.optim.AdamW` in this process. Each side does one warm-up step, then the sides take
turns for `--repeats` rounds (so load from other processes hits both alike) and the median
step of each is reported. Threads: both sides use `--threads` intra-op threads.

`--smoke`: a 1-layer model of hidden 64, batch 2 x 32, one timed round: the same code path in
seconds (the suite runs it; its figures mean nothing).

Last line: JSON `{"megatron_s": m, "torch_s": t, "ratio": m / t}` (RESULT_KEYS).
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_workers import cpu_compat

logger = logging.getLogger(__name__)

RESULT_KEYS = ("megatron_s", "torch_s", "ratio")
SMOKE = {"layers": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "batch": 2, "seq": 32,
         "response": 16, "repeats": 1}


def make_batch(vocab: int, B: int, S: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A padded batch in verl's layout: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    P = S - T
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        p = int(torch.randint(P // 2, P + 1, (1,), generator=g))
        r = int(torch.randint(T // 2, T + 1, (1,), generator=g))
        attention_mask[b, P - p: P + r] = 1
        response_mask[b, :r] = 1
    input_ids = torch.randint(0, vocab, (B, S), generator=g) * attention_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "responses": input_ids[:, P:].clone(),
        "response_mask": response_mask,
    }


def torch_stepper(model_dir: Path, batch: dict[str, torch.Tensor]):
    """A closure doing one plain PyTorch step (transformers model + AdamW)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    T = batch["responses"].shape[1]
    mask = batch["response_mask"].float()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits[:, -T - 1: -1]  # (B, T, V)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def timed_alternating(steps: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds per step of each closure; one warm-up each, then the closures take turns,
    so background load on a shared machine hits both sides alike."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def run(model_dir: Path, batch: dict[str, torch.Tensor], repeats: int, threads: int) -> dict[str, float]:
    """Median step seconds of both sides: a one-rank Megatron group (private Ray cluster) and PyTorch."""
    import ray

    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig, MegatronConfig, OptimConfig
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout

    B = batch["input_ids"].shape[0]
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=B, optim=OptimConfig(lr=1e-5, clip_grad=1.0, weight_decay=0.0),
                      megatron=MegatronConfig(dtype="float32"))  # the same precision as the plain PyTorch step
    ray.init(num_cpus=max(threads, 1), include_dashboard=False, log_to_driver=False)
    try:
        # Both thread pools: the group's CPU default (1) for MKL would leave its matmuls single-threaded.
        threads_env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        group = MegatronWorkerGroup(ParallelLayout(), [{"num_cpus": 1}], env_vars=threads_env)
        try:
            group.build(functools.partial(MegatronActor, str(model_dir), cfg))
            return timed_alternating(
                {"megatron": lambda: group.dispatch("update_sft", batch), "torch": torch_stepper(model_dir, batch)},
                repeats,
            )
        finally:
            group.shutdown()
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and batch, one round: the code path in seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    cpu_compat.apply_cpu_compat()  # this process's start (it imports the Megatron worker classes)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="polyturn-bench-ray-"))

    from recipe.tiny_model import write_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="polyturn-bench-") as tmp:
        model_dir = write_tiny_checkpoint(
            Path(tmp) / "model", layers=args.layers, hidden=args.hidden, heads=args.heads,
            kv_heads=args.kv_heads, intermediate=args.intermediate, seed=0,
        )
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        batch = make_batch(vocab, args.batch, args.seq, args.response)
        times = run(model_dir, batch, args.repeats, args.threads)
        megatron_s, torch_s = times["megatron"], times["torch"]
        logger.info("megatron step: %.3f s, torch step: %.3f s", megatron_s, torch_s)
    result = {"megatron_s": round(megatron_s, 4), "torch_s": round(torch_s, 4), "ratio": round(megatron_s / torch_s, 3)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
