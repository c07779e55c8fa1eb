"""Per-token log-probabilities and entropy from vocab-parallel logits.

With tensor parallelism the LM head is column-parallel: each TP rank holds logits for a
contiguous slice of the vocabulary, ``(..., V / tp)``. Gathering the full vocabulary on one
rank costs ``tp`` times the memory of the largest activation in the model, so this module
never does it. Instead it all-reduces three small per-token quantities over the TP group:

- the max logit (for a stable log-sum-exp),
- the sum of ``exp(z - max)`` (the softmax normaliser),
- the target token's logit (only the rank owning the target id contributes) and
  ``sum_v p_v z_v`` (for the entropy).

Where it departs from the textbook ``log_softmax(...).gather(...)`` + ``-(p * log p).sum()``:
log-prob and entropy are one ``torch.autograd.Function`` with a hand-written backward,

    d logp / d z_j  = onehot_j - p_j
    d H    / d z_j  = p_j * (E_p[z] - z_j)

which needs no communication in the backward (every term is local given the forward's
all-reduced ``E_p[z]``). Autograd through an all-reduce would get the entropy gradient wrong:
``p_j`` depends on every rank's logits through the normaliser, and each rank's graph only
sees its own share of that dependence.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs_entropy"]


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: Optional[dist.ProcessGroup]) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Fused log-prob of the target id and entropy of softmax(z), z sharded over the last dim."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):  # logits (..., Vp), target (...)
        z = logits.float()
        z_max = z.max(dim=-1).values  # (...)
        _all_reduce(z_max, dist.ReduceOp.MAX, group)
        exp_z = torch.exp(z - z_max.unsqueeze(-1))  # (..., Vp)
        sum_exp = exp_z.sum(dim=-1)  # (...)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        p = exp_z / sum_exp.unsqueeze(-1)  # (..., Vp) this rank's slice of the softmax
        lse = torch.log(sum_exp) + z_max  # (...)

        vocab_part = z.shape[-1]
        local_target = target - vocab_start  # (...)
        owned = (local_target >= 0) & (local_target < vocab_part)  # (...)
        safe_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        target_logit = torch.gather(z, -1, safe_target.unsqueeze(-1)).squeeze(-1)  # (...)
        target_logit = torch.where(owned, target_logit, torch.zeros_like(target_logit))
        mean_z = (p * z).sum(dim=-1)  # (...) this rank's share of E_p[z]
        reduced = torch.stack([target_logit, mean_z])  # (2, ...)
        _all_reduce(reduced, dist.ReduceOp.SUM, group)
        target_logit, mean_z = reduced[0], reduced[1]

        log_prob = target_logit - lse  # (...)
        entropy = lse - mean_z  # (...)
        ctx.save_for_backward(p, z, mean_z, safe_target, owned)
        ctx.input_dtype = logits.dtype
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        p, z, mean_z, safe_target, owned = ctx.saved_tensors
        grad = torch.zeros_like(p)  # (..., Vp)
        if grad_log_prob is not None:
            grad -= p * grad_log_prob.unsqueeze(-1)
            onehot_grad = torch.where(owned, grad_log_prob, torch.zeros_like(grad_log_prob))
            grad.scatter_add_(-1, safe_target.unsqueeze(-1), onehot_grad.unsqueeze(-1))
        if grad_entropy is not None:
            grad += p * (mean_z.unsqueeze(-1) - z) * grad_entropy.unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(log_prob, entropy)`` of ``target`` under ``softmax(logits / temperature)``.

    ``logits (..., V/tp)`` is this rank's contiguous vocabulary slice (rank ``r`` of the
    ``group`` holds ids ``[r * V/tp, (r+1) * V/tp)``, Megatron's column-parallel layout);
    ``target (...)`` holds global token ids. Both outputs have shape ``(...)``, are computed in
    fp32, are identical on every rank of ``group`` and carry gradients to ``logits``.
    ``group=None`` (or a group of one) means the full vocabulary is local.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: logits must "
            "be target's shape plus a trailing vocabulary dimension"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    vocab_start = rank * logits.shape[-1]
    if temperature != 1.0:
        logits = logits / temperature
    return _VocabParallelLogProbEntropy.apply(logits, target.long(), vocab_start, group)
