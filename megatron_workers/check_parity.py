"""Parity check: an HF checkpoint run by Megatron-Core at TP x PP against transformers itself.

    python -m megatron_workers.check_parity --hf DIR --tp 2 --pp 2 [--seed 0]

The driver validates the layout and the checkpoint's tensors (refusing before any process
starts), runs transformers' own forward (fp32, eager attention) on a fixed, seeded, right-padded
batch of variable-length sequences, then spawns TP*PP gloo/NCCL processes that each load their
shards, run the batch's real tokens packed (`packing.pack`, THD) through Megatron's pipeline schedule (forward only)
and export the weights back to HF names. It compares, on valid positions only, logits and the
per-token log-probs of the next token (Megatron's from its vocab-parallel cross entropy, i.e. the
path the actor uses), and requires the HF -> Megatron -> HF round trip to be bit-exact.

The last stdout line is JSON: {"tp", "pp", "max_abs_logit_diff", "max_abs_logprob_diff",
"roundtrip_exact"} (plus "error" when the check could not run). Exit status: 0 when both diffs
are <= the tolerance and the round trip is exact, 1 when not, 2 when the check could not run.
Details of any mismatch go to stderr.

The CLI and every spawned rank start with `cpu_compat.apply_cpu_compat()`, so the modules that
import megatron (`megatron_workers.model`, `.adapters`, `.parallel`) are imported inside the functions here.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_workers import cpu_compat
from megatron_workers.ports import free_port

logger = logging.getLogger(__name__)

TOLERANCE = 1e-4


@dataclass
class ParityBatch:
    """A right-padded batch: `input_ids` (B, T), `attention_mask` (B, T) with 1 on real tokens."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)


@dataclass
class ParityReport:
    """What the check found. `mismatches` names every failed comparison (empty when it passed)."""

    tp: int
    pp: int
    max_abs_logit_diff: float
    max_abs_logprob_diff: float
    roundtrip_exact: bool
    mismatches: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def summary(self) -> dict[str, Any]:
        """The JSON line's fields."""
        d = asdict(self)
        d.pop("mismatches")
        return d


def make_batch(vocab_size: int, seed: int, lengths: tuple[int, ...] = (16, 11, 5, 13)) -> ParityBatch:
    """Seeded random token ids, right-padded to max(lengths) with token 0."""
    gen = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(0, vocab_size, (len(lengths), length), generator=gen)  # (B, T)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T)
    return ParityBatch(input_ids=ids * mask, attention_mask=mask)


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | prefix) from full-vocab logits (B, T, V) -> (B, T-1)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def hf_reference(hf_dir: str | Path, batch: ParityBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own logits (B, T, V) and next-token log-probs (B, T-1), fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    return logits, next_token_logprobs(logits, batch.input_ids)


def _megatron_forward(model: torch.nn.Module, batch: ParityBatch) -> dict[str, torch.Tensor] | None:
    """Forward through Megatron's pipeline schedule; on the last stage: full logits and log-probs."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_workers.attention import packed_seq_params
    from megatron_workers.packing import pack

    device = next(model.parameters()).device
    ids = batch.input_ids.to(device)  # (B, T)
    real = batch.attention_mask.bool().to(device)  # (B, T)
    packed = pack(batch.input_ids, batch.attention_mask)  # the real tokens, (1, t)
    params = packed_seq_params(packed.cu_seqlens.to(device), packed.max_seqlen)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shard = output.new_zeros(*ids.shape, output.shape[-1]).float()  # (B, T, V/tp), 0 on padding
        shard[real] = output[0].float()  # (t, V/tp) back onto the padded batch
        logprobs = -tensor_parallel.vocab_parallel_cross_entropy(shard[:, :-1].clone(), ids[:, 1:])  # (B, T-1)
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(shard)  # (B, T, V)
        return torch.zeros((), device=device), {"logits": logits.cpu(), "logprobs": logprobs.cpu()}

    def forward_step(_data_iterator: None, gpt: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        return gpt(packed.ids.to(device), packed.positions.to(device), None, packed_seq_params=params), loss_func

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=None,  # one micro-batch, closed over by forward_step
            model=[model],
            num_microbatches=1,
            seq_length=packed.ids.shape[1],
            micro_batch_size=1,
            forward_only=True,
        )
    return outputs[0] if parallel_state.is_pipeline_last_stage() else None


def _roundtrip_mismatches(
    original: dict[str, torch.Tensor], exported: dict[str, torch.Tensor], hf_config: Any
) -> list[str]:
    """Names of tensors that the HF -> Megatron -> HF round trip lost, added or changed."""
    from megatron_workers import adapters

    expected = set(adapters.hf_tensor_shapes(hf_config))
    problems = [f"round trip: {n} missing from the export" for n in sorted(expected - set(exported))]
    problems += [f"round trip: unexpected tensor {n} in the export" for n in sorted(set(exported) - expected)]
    for name in sorted(expected & set(exported)):
        ref, got = original[name], exported[name].to(original[name].dtype)
        if not torch.equal(ref, got):
            diff = (ref.float() - got.float()).abs().max().item()
            problems.append(f"round trip: {name} changed (max abs diff {diff:.3g})")
    return problems


def _worker(
    rank: int, world_size: int, port: int, hf_dir: str, hf_config: dict[str, Any], tp: int, pp: int,
    batch: ParityBatch, out_dir: str,
) -> None:
    """One Megatron rank: load shards, forward the batch, export, write results to out_dir."""
    backend = cpu_compat.apply_cpu_compat()  # this spawned process's start
    from megatron.core import parallel_state

    from megatron_workers import adapters, model, parallel

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    parallel.init_distributed(rank, world_size, "127.0.0.1", port, tp, pp, backend=backend, timeout_minutes=5)
    try:
        state = model.load_hf_state_dict(hf_dir)
        gpt = model.build_gpt_model(hf_config)
        adapters.load_hf_weights(gpt, state, hf_config)
        gpt.eval()
        result: dict[str, Any] = {}
        forward = _megatron_forward(gpt, batch)
        if forward is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            result.update(forward)
        exported = adapters.export_hf_state_dict(gpt, hf_config, dst_rank=0)
        if exported is not None:
            result["roundtrip"] = _roundtrip_mismatches(state, exported, hf_config)
        if result:
            torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel.destroy()


def _compare(name: str, ref: torch.Tensor, got: torch.Tensor, valid: torch.Tensor, problems: list[str]) -> float:
    """Max abs diff of `got` vs `ref` where `valid` (B, T) is set; appends a message above TOLERANCE."""
    diff = (ref - got).abs()
    diff = diff.amax(dim=-1) if diff.dim() == 3 else diff  # (B, T)
    diff = torch.where(valid.bool(), diff, torch.zeros_like(diff))
    worst = diff.max().item()
    if not worst <= TOLERANCE:
        b, t = divmod(int(diff.argmax()), diff.shape[1])
        problems.append(f"{name} differ by {worst:.3g} > {TOLERANCE} (worst at sequence {b}, position {t})")
    return worst


def run_parity(hf_dir: str | Path, tp: int, pp: int, seed: int = 0) -> ParityReport:
    """Run the whole check; raises ValueError (before spawning) for a bad layout or checkpoint.

    Needs `cpu_compat.apply_cpu_compat()` at this process's start (`main` calls it).
    """
    from megatron_workers import adapters, model, parallel

    hf_config, state = model.load_hf_checkpoint(hf_dir)
    parallel.validate_layout(hf_config, tp, pp)
    adapters.check_hf_state_dict(state, hf_config)
    shape = adapters.read_decoder_shape(hf_config)
    batch = make_batch(shape.vocab_size, seed)
    ref_logits, ref_logprobs = hf_reference(hf_dir, batch)
    world_size = tp * pp
    with tempfile.TemporaryDirectory(prefix="polyturn-parity-") as out_dir:
        mp.spawn(
            _worker,
            args=(world_size, free_port(), str(hf_dir), hf_config.to_dict(), tp, pp, batch, out_dir),
            nprocs=world_size,
            join=True,
        )
        last_stage = world_size - tp  # tp rank 0 of the last pipeline stage (order tp-...-pp)
        forward = torch.load(Path(out_dir) / f"rank{last_stage}.pt")
        roundtrip = torch.load(Path(out_dir) / "rank0.pt")["roundtrip"]
    problems: list[str] = []
    logit_diff = _compare("logits", ref_logits, forward["logits"], batch.attention_mask, problems)
    logprob_diff = _compare("log-probs", ref_logprobs, forward["logprobs"], batch.attention_mask[:, 1:], problems)
    return ParityReport(
        tp, pp, logit_diff, logprob_diff, roundtrip_exact=not roundtrip, mismatches=problems + roundtrip
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit status (0 pass, 1 mismatch, 2 could not run)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random test batch")
    args = parser.parse_args(argv)
    cpu_compat.apply_cpu_compat()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = run_parity(args.hf, args.tp, args.pp, args.seed)
    except (ValueError, FileNotFoundError, mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        logger.error("parity check could not run: %s", exc)
        print(json.dumps({"tp": args.tp, "pp": args.pp, "error": str(exc).strip().splitlines()[-1]}))
        return 2
    for problem in report.mismatches:
        logger.error("%s", problem)
    print(json.dumps(report.summary()))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
