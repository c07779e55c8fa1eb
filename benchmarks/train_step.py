"""One Megatron actor update vs one plain PyTorch update of the same model on the same batch; and the same
Megatron update on a multi-turn length mix, packed (real tokens only) vs padded.

    python -m benchmarks.train_step [--layers 4 --hidden 256 --batch 16 --seq 256 --repeats 5] [--smoke]

Against PyTorch, both sides run the same step on CPU in fp32: masked token-mean cross-entropy over
the response tokens of a padded batch (`update_sft`, the same forward/backward/clip/Adam path as
`update_policy`), gradient clipping at 1.0, Adam. The Megatron side is a TP=1, PP=1 worker
group on Ray (one rank, gloo), timed from the driver, so it includes dispatch (pickling the
batch to the actor) and the finite-gradient check. The PyTorch side is a transformers model
and `torch.optim.AdamW` in this process.

Packed vs padded: `--mix-batch` rows of seeded multi-turn lengths (prompts 200-350 tokens, responses
100-1500), micro-batches cut by a token budget of 4 padded rows (`ppo_max_token_len_per_gpu`). Packed
is the Megatron path as it is: each micro-batch holds only real tokens. Padded is the same rows with
every padding position made a real token (attention mask all ones), so each row costs its full
padded length, 4 rows per micro-batch: the work the padded layout did (whose dense attention did
more still). `*_tokens_per_s` count the real tokens only; `padding_fraction` is the share of the
padded path's tokens that are padding; `peak_mem_mb` is a fresh rank's peak resident memory during
its first packed update above its memory before it (sampled every 2 ms, with glibc mapping large
allocations on their own so that freed memory leaves; Adam's moments, created by that update, are
included), `padded_peak_mem_mb` the same for padded.

All steps take turns for `--repeats` rounds after one warm-up each (so load from other processes hits
every side alike) and the median of each is reported. Threads: every side uses `--threads`
intra-op threads.

`--smoke`: a 1-layer model of hidden 64 and tiny batches, one timed round: the same code path in
seconds (the suite runs it; its figures mean nothing).

Last line: JSON with RESULT_KEYS: `ratio` = megatron_s / torch_s, `packed_speedup` =
packed_tokens_per_s / padded_tokens_per_s.
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

RESULT_KEYS = ("megatron_s", "torch_s", "ratio", "packed_tokens_per_s", "padded_tokens_per_s", "packed_speedup",
               "padding_fraction", "peak_mem_mb", "padded_peak_mem_mb")
SMOKE = {"layers": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "batch": 2, "seq": 32,
         "response": 16, "repeats": 1, "mix_batch": 4, "prompt_len": (8, 12), "response_len": (4, 20)}
ROWS_PER_PADDED_MICRO_BATCH = 4
# glibc keeps freed heap memory resident; with every allocation of 64 KiB or more mapped on its own (and unmapped when
# freed), the rank's resident memory follows what it holds, so sampling it finds the update's peak.
PEAK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}


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


def mixed_batch(vocab: int, B: int, prompt_len: tuple[int, int], response_len: tuple[int, int],
                seed: int = 1) -> dict[str, torch.Tensor]:
    """`B` rows of seeded multi-turn lengths (prompt and response token counts drawn uniformly from the ranges),
    padded to the longest in verl's layout."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt_len[0], prompt_len[1] + 1, (B,), generator=g)
    responses = torch.randint(response_len[0], response_len[1] + 1, (B,), generator=g)
    P, T = int(prompts.max()), int(responses.max())
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        attention_mask[b, P - int(prompts[b]): P + int(responses[b])] = 1
        response_mask[b, :int(responses[b])] = 1
    input_ids = torch.randint(1, vocab, (B, P + T), generator=g) * attention_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": input_ids[:, P:].clone(),
            "response_mask": response_mask}


def as_padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same rows with every padding position made a real token: each row costs its full padded length."""
    mask = torch.ones_like(batch["attention_mask"])
    return {**batch, "attention_mask": mask, "position_ids": mask.cumsum(1) - 1}


def with_peak_memory(role_cls: type) -> type:
    """`role_cls` plus `update_sft_peak`: update_sft's metrics and the rank's peak resident memory during it above
    its memory before it (`peak_mem_mb`, sampled every 2 ms)."""

    class Probe(role_cls):
        def update_sft_peak(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
            import threading

            import psutil

            proc = psutil.Process()
            base = proc.memory_info().rss
            peak, done = [base], threading.Event()

            def sample() -> None:
                while not done.wait(0.002):
                    peak[0] = max(peak[0], proc.memory_info().rss)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                metrics = self.update_sft(batch)
            finally:
                done.set()
                sampler.join()
            return {**metrics, "peak_mem_mb": (max(peak[0], proc.memory_info().rss) - base) / 2**20}

    return Probe


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


def run(model_dir: Path, batch: dict[str, torch.Tensor], mix: dict[str, torch.Tensor], repeats: int,
        threads: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median step seconds of every side (a one-rank Megatron group on a private Ray cluster: on `batch`, on `mix`
    packed and padded; PyTorch on `batch`), and the peak memory of one packed and one padded update on `mix`."""
    import ray

    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig, MegatronConfig, OptimConfig
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout

    B = batch["input_ids"].shape[0]
    budget = max(ROWS_PER_PADDED_MICRO_BATCH * mix["input_ids"].shape[1], B * batch["input_ids"].shape[1])
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=B, ppo_max_token_len_per_gpu=budget,
                      optim=OptimConfig(lr=1e-5, clip_grad=1.0, weight_decay=0.0),
                      megatron=MegatronConfig(dtype="float32"))  # the same precision as the plain PyTorch step
    padded = as_padded(mix)
    ray.init(num_cpus=max(threads, 1), include_dashboard=False, log_to_driver=False)
    try:
        # Both thread pools: the group's CPU default (1) for MKL would leave its matmuls single-threaded.
        threads_env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        group = MegatronWorkerGroup(ParallelLayout(), [{"num_cpus": 1}], env_vars=threads_env)
        try:
            group.build(functools.partial(MegatronActor, str(model_dir), cfg))
            times = timed_alternating({
                "megatron": lambda: group.dispatch("update_sft", batch),
                "torch": torch_stepper(model_dir, batch),
                "packed": lambda: group.dispatch("update_sft", mix),
                "padded": lambda: group.dispatch("update_sft", padded),
            }, repeats)
        finally:
            group.shutdown()
        peaks = {}
        for name, b in (("packed", mix), ("padded", padded)):  # each in a fresh rank: its first update
            group = MegatronWorkerGroup(ParallelLayout(), [{"num_cpus": 1}], env_vars={**threads_env, **PEAK_ENV})
            try:
                group.build(functools.partial(with_peak_memory(MegatronActor), str(model_dir), cfg))
                peaks[name] = group.dispatch("update_sft_peak", b)[0]["peak_mem_mb"]
            finally:
                group.shutdown()
        return times, peaks
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
    ap.add_argument("--mix-batch", type=int, default=16, help="rows of the multi-turn length mix")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and batch, one round: the code path in seconds")
    args = ap.parse_args(argv)
    vars(args).update(prompt_len=(200, 350), response_len=(100, 1500))  # the multi-turn length mix
    if args.smoke:
        vars(args).update(SMOKE)
    cpu_compat.apply_cpu_compat()  # this process's start (it imports the Megatron worker classes)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)

    from recipe.tiny_model import write_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="polyturn-bench-") as tmp:
        os.environ.setdefault("RAY_TMPDIR", str(Path(tmp) / "ray"))
        model_dir = write_tiny_checkpoint(
            Path(tmp) / "model", layers=args.layers, hidden=args.hidden, heads=args.heads,
            kv_heads=args.kv_heads, intermediate=args.intermediate, seed=0,
        )
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        batch = make_batch(vocab, args.batch, args.seq, args.response)
        mix = mixed_batch(vocab, args.mix_batch, args.prompt_len, args.response_len)
        times, peaks = run(model_dir, batch, mix, args.repeats, args.threads)
    megatron_s, torch_s = times["megatron"], times["torch"]
    real = int(mix["attention_mask"].sum())
    packed, padded = real / times["packed"], real / times["padded"]
    logger.info("megatron step: %.3f s, torch step: %.3f s; length mix (%d real tokens of %d): packed %.3f s, "
                "padded %.3f s", megatron_s, torch_s, real, mix["attention_mask"].numel(), times["packed"],
                times["padded"])
    result = {"megatron_s": round(megatron_s, 4), "torch_s": round(torch_s, 4), "ratio": round(megatron_s / torch_s, 3),
              "packed_tokens_per_s": round(packed, 1), "padded_tokens_per_s": round(padded, 1),
              "packed_speedup": round(packed / padded, 3),
              "padding_fraction": round(1 - real / mix["attention_mask"].numel(), 3),
              "peak_mem_mb": round(peaks["packed"], 1), "padded_peak_mem_mb": round(peaks["padded"], 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
