"""Per-token log-probabilities and entropy from vocab-parallel logits, in token chunks.

With tensor parallelism the LM head is column-parallel: each TP rank holds logits for a
contiguous slice of the vocabulary, ``(..., V / tp)``. Gathering the full vocabulary on one
rank costs ``tp`` times the memory of the largest activation in the model, so this module
never does it. Each rank reduces its slice to four per-token numbers (max logit ``m``,
``s = sum exp(z - m)``, ``t = sum exp(z - m) (z - m)``, the target's logit where it owns the target
id) and the TP group combines them with one MAX and one SUM all-reduce into the global max ``M``,
``S`` and ``C = E_p[z] - M``: ``log_prob = (z_target - M) - log S`` and ``entropy = log S - C``. Every
term is centred on the max, so the entropy is not the difference of two large numbers
(``lse - E_p[z]``), which in fp32 loses ~1e-6 at logits around 10.

Where it departs from the textbook ``log_softmax(...).gather(...)`` + ``-(p * log p).sum()``:

- One ``torch.autograd.Function`` with a hand-written backward,

      d logp / d z_j  = onehot_j - p_j
      d H    / d z_j  = p_j * (E_p[z] - z_j)

  which needs no communication (every term is local given the forward's ``lse`` and ``E_p[z]``).
  Autograd through an all-reduce would get the entropy gradient wrong: ``p_j`` depends on every
  rank's logits through the normaliser, and each rank's graph only sees its own share of it.
- Tokens are processed ``chunk_tokens`` at a time, each chunk cast to fp32 inside (bf16 logits
  get an fp32 log-softmax), and the backward recomputes ``p`` chunk by chunk. Nothing
  vocabulary-sized is saved in fp32: `vocab_parallel_logprobs_entropy` keeps only its input
  logits (in their own dtype) and three fp32 numbers per token; `linear_logprobs_entropy`, which
  also takes over the LM head's matmul, keeps no logits at all (memory O(b*T) beyond the hidden
  states and head weight the LM head keeps anyway). Transient memory is O(chunk_tokens * V/tp).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["linear_logprobs_entropy", "vocab_parallel_logprobs_entropy"]

CHUNK_TOKENS = 1024
"""Tokens per chunk: bounds the fp32 transient at CHUNK_TOKENS x V/tp x a few tensors."""


def _tp_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """fp32 logits of a chunk: `x (n, Vp)` itself, or `x (n, h) @ weight (Vp, h).T`, divided by temperature."""
    z = x if weight is None else x @ weight.t()  # (n, Vp)
    z = z.float()
    return z / temperature if temperature != 1.0 else z


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """log-prob of the target id and entropy of softmax(z), z = logits or x @ weight.T sharded over the vocabulary."""

    @staticmethod
    def forward(ctx, x, weight, target, vocab_start, group, temperature, chunk):
        # x (N, Vp) logits or (N, h) hidden states; weight None or (Vp, h); target (N,) global ids
        n_tok = x.shape[0]
        stats = torch.empty(4, n_tok, dtype=torch.float32, device=x.device)  # m, s, t, z_target
        vocab_part = x.shape[1] if weight is None else weight.shape[0]
        local_target = target - vocab_start  # (N,)
        owned = (local_target >= 0) & (local_target < vocab_part)  # (N,)
        safe_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        with torch.no_grad():
            for lo in range(0, n_tok, chunk):
                hi = min(lo + chunk, n_tok)
                z = _chunk_logits(x[lo:hi], weight, temperature)  # (n, Vp) fp32
                m = z.max(dim=-1).values  # (n,)
                zc = z - m.unsqueeze(-1)  # (n, Vp) <= 0
                e = torch.exp(zc)  # (n, Vp)
                stats[0, lo:hi] = m
                stats[1, lo:hi] = e.sum(dim=-1)
                stats[2, lo:hi] = (e * zc).sum(dim=-1)
                stats[3, lo:hi] = torch.gather(z, -1, safe_target[lo:hi].unsqueeze(-1)).squeeze(-1)
        stats[3] = torch.where(owned, stats[3], torch.zeros_like(stats[3]))
        m_all = stats[0].clone()  # (N,)
        _tp_reduce(m_all, dist.ReduceOp.MAX, group)
        shift = stats[0] - m_all  # (N,) <= 0: this rank's max below the global one
        scale = torch.exp(shift)
        # sum exp(z - M) and sum exp(z - M) (z - M) from this rank's terms centred on its own max
        summed = torch.stack([stats[1] * scale, scale * (stats[2] + shift * stats[1]), stats[3]])  # (3, N)
        _tp_reduce(summed, dist.ReduceOp.SUM, group)
        log_s = torch.log(summed[0])  # (N,)
        centred_mean = summed[1] / summed[0]  # (N,) E_p[z] - M
        ctx.save_for_backward(x, weight, m_all, log_s, centred_mean, safe_target, owned)
        ctx.temperature, ctx.chunk = temperature, chunk
        return (summed[2] - m_all) - log_s, log_s - centred_mean

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        x, weight, m_all, log_s, centred_mean, safe_target, owned = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        n_tok = x.shape[0]
        g_lp = torch.zeros_like(log_s) if grad_log_prob is None else grad_log_prob.float()  # (N,)
        g_h = torch.zeros_like(log_s) if grad_entropy is None else grad_entropy.float()  # (N,)
        grad_x = torch.empty_like(x)
        grad_w = None if weight is None else torch.zeros_like(weight, dtype=torch.float32)
        for lo in range(0, n_tok, chunk):
            hi = min(lo + chunk, n_tok)
            zc = _chunk_logits(x[lo:hi], weight, temperature) - m_all[lo:hi].unsqueeze(-1)  # (n, Vp) z - M
            p = torch.exp(zc - log_s[lo:hi].unsqueeze(-1))  # (n, Vp)
            # dlogp/dz = onehot - p; dH/dz = p (E_p[z] - z)
            grad_z = p * ((centred_mean[lo:hi].unsqueeze(-1) - zc) * g_h[lo:hi].unsqueeze(-1)
                          - g_lp[lo:hi].unsqueeze(-1))
            onehot = torch.where(owned[lo:hi], g_lp[lo:hi], torch.zeros_like(g_lp[lo:hi]))  # (n,)
            grad_z.scatter_add_(-1, safe_target[lo:hi].unsqueeze(-1), onehot.unsqueeze(-1))
            if temperature != 1.0:
                grad_z /= temperature
            if weight is None:
                grad_x[lo:hi] = grad_z.to(x.dtype)
            else:
                grad_x[lo:hi] = (grad_z @ weight.float()).to(x.dtype)  # (n, h)
                grad_w += grad_z.t() @ x[lo:hi].float()  # (Vp, h)
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _apply(x, weight, target, group, temperature, chunk_tokens, vocab_part):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    lead = target.shape
    flat_x = x.reshape(-1, x.shape[-1])  # (N, Vp) or (N, h)
    log_prob, entropy = _ChunkedLogProbEntropy.apply(
        flat_x, weight, target.reshape(-1).long(), rank * vocab_part, group, float(temperature), chunk_tokens
    )
    return log_prob.reshape(lead), entropy.reshape(lead)


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(log_prob, entropy)`` of ``target`` under ``softmax(logits / temperature)``.

    ``logits (..., V/tp)`` is this rank's contiguous vocabulary slice (rank ``r`` of the
    ``group`` holds ids ``[r * V/tp, (r+1) * V/tp)``, Megatron's column-parallel layout);
    ``target (...)`` holds global token ids. Both outputs have shape ``(...)``, are computed in
    fp32 (whatever the logits' dtype), are identical on every rank of ``group`` and carry
    gradients to ``logits``. ``group=None`` (or a group of one) means the full vocabulary is local.
    Saved for backward: ``logits`` as given plus three fp32 numbers per token.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: logits must "
            "be target's shape plus a trailing vocabulary dimension"
        )
    return _apply(logits, None, target, group, temperature, chunk_tokens, logits.shape[-1])


def linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`vocab_parallel_logprobs_entropy(hidden @ weight.T, ...)` without ever holding the logits.

    ``hidden (..., h)`` are the LM head's inputs (identical on every TP rank), ``weight (V/tp, h)``
    this rank's slice of the column-parallel head. Gradients reach ``hidden`` (this rank's share:
    sum them over the TP group, as Megatron's column-parallel layer does) and ``weight``. Saved for
    backward: ``hidden``, ``weight`` and three fp32 numbers per token.
    """
    if hidden.shape[:-1] != target.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and target {tuple(target.shape)} disagree: "
            "hidden must be target's shape plus h, weight (V/tp, h)"
        )
    return _apply(hidden, weight, target, group, temperature, chunk_tokens, weight.shape[0])
