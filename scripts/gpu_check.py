"""One-GPU check of the Megatron actor in bf16, in-process: no Ray, no SGLang, no TransformerEngine, no network.

    bash scripts/gpu_check.sh [--small] [--rows N] [--peak-tflops T]

Needs only PyTorch, transformers and megatron-core (`gpu_check.sh` brings the latter as a wheel). One process
is a world of one rank (NCCL on a GPU, gloo plus the CPU adapter without one). The model has Qwen2.5-0.5B's
shapes (`benchmarks.weight_sync.write_random_checkpoint`: random bf16 weights, no download; `--small`: that
benchmark's 2-layer smoke shapes, for CPUs and tests). The batch has a realistic spread of lengths: prompts of
200-350 tokens, responses of 100-1500 (a tool span in the longer ones), packed into micro-batches of at most
4096 tokens; 16 rows on a GPU, 3 on a CPU (`CPU_ROWS`), `--rows` to choose. In order:

1. log-probs of an fp32 copy of the same (bf16-valued) weights, as the reference for the bf16 gap;
2. the bf16 actor (fp32 main params and Adam): log-probs and one PPO update (recipe.algos' policy loss) under
   `megatron_workers.device_check.discipline`, which refuses any op that mixes host and device tensors;
3. two more PPO updates, timed: tokens/s and MFU (`recipe.flops`; the peak is looked up by the GPU's name,
   or `--peak-tflops`);
4. the weight export into bf16 buckets (`megatron_workers.weights`, the streaming path, without an engine):
   every HF tensor, in GB/s;
5. an offload / onload round trip of params, grads and optimizer, with a weight export in between, as the
   trainer syncs in hybrid placement: device memory freed (GPU), the export's checksums equal the resident
   one's, and the log-probs after the round trip equal those before, bit for bit.

The last stdout line is JSON: device, ok, tokens_per_s, mfu (null without a known peak, always null on a
CPU), peak_mem_gb (the GPU's peak allocation; on a CPU the process's peak RSS), export_gbps,
logprob_gap_bf16_fp32 (largest |log p| gap over the sampled tokens), plus rows, tokens and the names of the
failed checks (or, when the check stopped, `error`: a mixed host/device op, an OOM, ...). The exit status is 0
exactly when ok is true.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import math
import platform
import re
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_workers import cpu_compat

logger = logging.getLogger("gpu_check")

RESULT_KEYS = ("device", "ok", "tokens_per_s", "mfu", "peak_mem_gb", "export_gbps", "logprob_gap_bf16_fp32")
LOGPROB_GAP_LIMIT = 1.0
"""Largest |log p_bf16 - log p_fp32| accepted: bf16 rounding moves a random model's log-probs by a few
hundredths (tests/test_bf16.py bounds it by 0.05 on the tiny model); a whole nat means a broken bf16 path."""
BUCKET_BYTES = 512 << 20


@dataclass(frozen=True)
class Lengths:
    """Token lengths of the check's batch: each row draws its prompt and response length uniformly."""

    rows: int
    prompt: tuple[int, int]
    response: tuple[int, int]
    tool_span: int
    """Tokens of one tool-response span (response_mask 0) in the middle of every response at least 3x longer."""
    micro_batch_tokens: int
    """Token budget of one micro-batch (rows x window length; `ppo_max_token_len_per_gpu`)."""


FULL = Lengths(rows=16, prompt=(200, 350), response=(100, 1500), tool_span=50, micro_batch_tokens=4096)
SMALL = Lengths(rows=4, prompt=(20, 35), response=(10, 150), tool_span=5, micro_batch_tokens=512)
CPU_ROWS = 3
"""Rows of the full-shape batch on a CPU (same lengths): 2 cores train Qwen2.5-0.5B's shapes at 50-65 tokens/s, so
the 16-row batch (~17k tokens, 3 updates) would take ~25 minutes; 3 rows took 5 minutes, 4 nearly 8
(docs/benchmarks/before-2026-12-07.md)."""


def write_model(out: Path, small: bool) -> Path:
    """A random HF checkpoint with bf16 weights: Qwen2.5-0.5B's shapes, or (`small`) the weight-sync
    benchmark's 2-layer smoke shapes."""
    from benchmarks.weight_sync import QWEN2_5_0_5B, SMOKE, write_random_checkpoint

    write_random_checkpoint(out, dict(QWEN2_5_0_5B, **SMOKE) if small else QWEN2_5_0_5B)
    return out


def make_batch(vocab: int, lengths: Lengths, seed: int = 0) -> dict[str, torch.Tensor]:
    """A host batch in verl's layout: prompts left-padded to the longest prompt, responses right-padded,
    random token ids, one advantage per row (GRPO-like)."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi + 1, (lengths.rows,), generator=g).tolist()

    prompts, responses = draw(*lengths.prompt), draw(*lengths.response)
    P, T = max(prompts), max(responses)
    input_ids = torch.randint(1, vocab, (lengths.rows, P + T), generator=g)  # (B, S)
    attention_mask = torch.zeros(lengths.rows, P + T, dtype=torch.long)  # (B, S)
    response_mask = torch.zeros(lengths.rows, T, dtype=torch.long)  # (B, T)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        attention_mask[b, P - p: P + r] = 1
        response_mask[b, :r] = 1
        if r >= 3 * lengths.tool_span:  # a tool turn: attended to, not sampled
            mid = r // 2
            response_mask[b, mid: mid + lengths.tool_span] = 0
    input_ids = input_ids * attention_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),  # (B, S)
        "responses": input_ids[:, P:].clone(),  # (B, T)
        "response_mask": response_mask,
        "advantages": torch.randn(lengths.rows, 1, generator=g).expand(-1, T).contiguous(),  # (B, T)
    }


def device_name() -> str:
    """The GPU's name, or "cpu (<machine>, <n> threads)": every figure of a CPU run is marked by it."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def peak_tflops(name: str, configured: float | None) -> float | None:
    """Dense BF16 peak of this device: `--peak-tflops`, else `recipe.flops.PEAK_TFLOPS` by the longest table
    name in the device's name (an H100 PCIe reads as an SXM: pass --peak-tflops 756); None on a CPU."""
    from recipe.flops import PEAK_TFLOPS
    from recipe.flops import peak_tflops as lookup

    if name.startswith("cpu"):
        return None
    known = [k for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if re.search(rf"\b{re.escape(k)}\b", name)]
    return lookup(configured, known[0] if known else name)


def peak_mem_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free(*objs: object) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(backend: str, small: bool, rows: int | None, configured_peak: float | None) -> dict:
    """The check (module docstring) over torch.distributed `backend`; returns the result line's fields."""
    from megatron_workers import device_check, parallel
    from megatron_workers.actor import MegatronActor
    from megatron_workers.adapters import hf_tensor_shapes
    from megatron_workers.config import ActorConfig, MegatronConfig, OptimConfig
    from megatron_workers.ports import free_port
    from megatron_workers.sync_plan import SyncPlan
    from recipe.algos import PolicyLossConfig, policy_loss
    from recipe.flops import ModelFlops

    lengths = SMALL if small else FULL
    if rows is None and not small and not torch.cuda.is_available():
        rows = CPU_ROWS
    if rows is not None:
        lengths = Lengths(rows, lengths.prompt, lengths.response, lengths.tool_span, lengths.micro_batch_tokens)
    name = device_name()
    checks: dict[str, bool] = {}

    def check(what: str, passed: bool, detail: str) -> None:
        checks[what] = bool(passed)
        logger.info("check %-22s %s (%s)", what, "ok" if passed else "FAILED", detail)

    def cfg(dtype: str, optim: bool) -> ActorConfig:
        return ActorConfig(optim=OptimConfig(lr=1e-5) if optim else None, megatron=MegatronConfig(dtype=dtype),
                           use_dynamic_bsz=True, ppo_max_token_len_per_gpu=lengths.micro_batch_tokens)

    parallel.init_distributed(0, 1, "127.0.0.1", free_port(), tp=1, pp=1, backend=backend, seed=0)
    try:
        with tempfile.TemporaryDirectory(prefix="polyturn-gpu-check-") as tmp:
            model_dir = write_model(Path(tmp) / "model", small)
            ref = MegatronActor(model_dir, cfg("float32", optim=False))
            hf_config = ref.hf_config
            batch = make_batch(hf_config.vocab_size, lengths)
            mask = batch["response_mask"].bool()  # (B, T)
            seq_lens = batch["attention_mask"].sum(dim=1).tolist()
            tokens = int(sum(seq_lens))
            logger.info("%s: %d rows, %d tokens (sequences %d-%d), %s", name, lengths.rows, tokens,
                        min(seq_lens), max(seq_lens), "smoke shapes" if small else "Qwen2.5-0.5B shapes")
            lp32 = ref.compute_log_prob(batch)["log_probs"]  # (B, T)
            _free(ref)
            ref = None

            actor = MegatronActor(model_dir, cfg("bfloat16", optim=True))
            loss_fn = functools.partial(policy_loss, cfg=PolicyLossConfig())
            with device_check.discipline(host=batch.values(), device=actor.device_tensors()) as d:  # raises on a mix
                batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
                losses = [actor.update_policy(batch, loss_fn)["actor/pg_loss"]]
            check("host_device_discipline", d.crossings > 0, f"{d.crossings} tensors crossed the seam, "
                  "no op mixed host and device")
            gap = float((batch["old_log_probs"] - lp32).abs()[mask].max())
            check("logprob_gap_bf16_fp32", gap < LOGPROB_GAP_LIMIT,
                  f"max {gap:.4f}, mean {float((batch['old_log_probs'] - lp32).abs()[mask].mean()):.5f}")

            _sync()
            t0 = time.perf_counter()
            for _ in range(2):
                losses.append(actor.update_policy(batch, loss_fn)["actor/pg_loss"])
            _sync()
            seconds = time.perf_counter() - t0
            check("loss_finite", all(math.isfinite(x) for x in losses), f"pg_loss {losses}")
            tokens_per_s = 2 * tokens / seconds
            peak = peak_tflops(name, configured_peak)
            mfu = 2 * ModelFlops.from_hf_config(hf_config).training(seq_lens) / (seconds * peak * 1e12) \
                if peak else None

            plan = SyncPlan(transport="none", bucket_bytes=BUCKET_BYTES, dtype="bfloat16", key="gpu_check",
                            checksums=True)
            actor.send_weights(plan)  # warm-up: the first export allocates the buckets' memory
            export = actor.send_weights(plan)
            want = sum(math.prod(s) for s in hf_tensor_shapes(hf_config).values()) * torch.bfloat16.itemsize
            check("weight_export", export is not None and export["bytes"] == want,
                  f"{export and export['bytes']:.0f} of {want} bytes in {export and export['buckets']:.0f} buckets")
            export_gbps = export["bytes"] / export["seconds"] / 1e9 if export else None

            # As in hybrid placement: offload after training, sync the weights from the offloaded actor, onload.
            before = actor.compute_log_prob(batch)["log_probs"]
            resident = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
            actor.offload(params=True, grads=True, optimizer=True)
            offloaded = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
            synced = actor.send_weights(plan)
            left = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
            actor.onload()
            after = actor.compute_log_prob(batch)["log_probs"]
            freed = "" if resident is None else f", {resident / 1e9:.2f} -> {offloaded / 1e9:.2f} GB on the device"
            check("offload_round_trip", torch.equal(before, after)
                  and (resident is None or offloaded < 0.2 * resident), f"log-probs equal after onload{freed}")
            check("export_while_offloaded", synced is not None and export is not None
                  and synced["stats"] == export["stats"] and (left is None or left - offloaded < 0.05 * resident),
                  "the same checksums as the resident export, the parameters offloaded again after it")
    finally:
        parallel.destroy()
    failed = [k for k, v in checks.items() if not v]
    return {"device": name, "ok": not failed, "tokens_per_s": round(tokens_per_s, 1),
            "mfu": None if mfu is None else round(mfu, 4), "peak_mem_gb": round(peak_mem_gb(), 2),
            "export_gbps": None if export_gbps is None else round(export_gbps, 3),
            "logprob_gap_bf16_fp32": round(gap, 5), "rows": lengths.rows, "tokens": tokens, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="2-layer smoke shapes and short sequences (CPUs, tests)")
    parser.add_argument("--rows", type=int, default=None, help=f"batch rows (default {FULL.rows} on a GPU, "
                        f"{CPU_ROWS} on a CPU; --small: {SMALL.rows})")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense BF16 peak TFLOPS of the GPU, when its name is not in recipe.flops.PEAK_TFLOPS")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    backend = cpu_compat.apply_cpu_compat()  # this process's start: before anything imports megatron
    try:
        result = run(backend, args.small, args.rows, args.peak_tflops)
    except Exception as e:  # the result line says what stopped it (a mixed host/device op, OOM, ...)
        logger.exception("the check stopped")
        result = {**dict.fromkeys(RESULT_KEYS), "device": device_name(), "ok": False,
                  "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
