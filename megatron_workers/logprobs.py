"""Per-token log-probabilities and entropy of the LM head's vocab-parallel softmax, fused with its matmul, in
token chunks.

With tensor parallelism the LM head is column-parallel: each TP rank holds a contiguous slice of the
vocabulary's rows of the head weight, `(V / tp, h)`, and so of the logits. Gathering the full vocabulary on
one rank costs `tp` times the memory of the largest activation in the model, and even one rank's logits
`(tokens, V / tp)` kept for backward are the largest tensor of a step (about 3 GB per micro-batch at Qwen's
vocabulary), so this module never holds them: it takes the head's input and weight and projects a chunk of
tokens at a time. Each rank reduces its slice to four per-token numbers (max logit `m`,
`s = sum exp(z - m)`, `t = sum exp(z - m) (z - m)`, the target's logit where it owns the target id) and the
TP group combines them with one MAX and one SUM all-reduce into the global max `M`, `S` and
`C = E_p[z] - M`: `log_prob = (z_target - M) - log S` and `entropy = log S - C`. Every term is centred on
the max, so the entropy is not the difference of two large numbers (`lse - E_p[z]`), which in fp32 loses
~1e-6 at logits around 10.

Where it departs from the textbook `log_softmax(x @ W.T).gather(...)` + `-(p * log p).sum()`:

- One `torch.autograd.Function` with a hand-written backward,

      d logp / d z_j  = onehot_j - p_j
      d H    / d z_j  = p_j * (E_p[z] - z_j)

  which needs no communication (every term is local given the forward's `lse` and `E_p[z]`).
  Autograd through an all-reduce would get the entropy gradient wrong: `p_j` depends on every
  rank's logits through the normaliser, and each rank's graph only sees its own share of it.
- Each chunk's logits are cast to fp32 (bf16 weights get an fp32 log-softmax), and the backward
  recomputes them chunk by chunk: one more head matmul per token, for memory O(tokens) beyond the
  head's input and weight (three fp32 numbers per token). Transient memory is O(chunk_tokens * V/tp).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["linear_logprobs_entropy"]

CHUNK_TOKENS = 1024
"""Tokens per chunk: bounds the fp32 transient at CHUNK_TOKENS x V/tp x a few tensors."""


def _tp_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits of a chunk, `x (n, h) @ weight (Vp, h).T`, divided by temperature."""
    z = (x @ weight.t()).float()  # (n, Vp)
    return z / temperature if temperature != 1.0 else z


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """log-prob of the target id and entropy of softmax(z), z = x @ weight.T sharded over the vocabulary."""

    @staticmethod
    def forward(ctx, x, weight, target, vocab_start, group, temperature, chunk):
        # x (N, h) hidden states; weight (Vp, h); target (N,) global ids
        n_tok = x.shape[0]
        stats = torch.empty(4, n_tok, dtype=torch.float32, device=x.device)  # m, s, t, z_target
        vocab_part = weight.shape[0]
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
        grad_w = torch.zeros_like(weight, dtype=torch.float32)  # (Vp, h) accumulated over chunks
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
            grad_z = grad_z.to(weight.dtype)  # the logits' gradient in the head's dtype, as its linear layer has it
            grad_x[lo:hi] = grad_z @ weight  # (n, h)
            grad_w += grad_z.t() @ x[lo:hi]  # (Vp, h)
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None


def linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(log_prob, entropy)` of `target` under `softmax(hidden @ weight.T / temperature)`, without ever
    holding the logits.

    `hidden (..., h)` are the LM head's inputs (identical on every TP rank), `weight (V/tp, h)` this rank's
    slice of the column-parallel head: rank `r` of `group` holds ids `[r * V/tp, (r+1) * V/tp)`, Megatron's
    layout; `target (...)` holds global token ids. Both outputs have shape `(...)`, are computed in fp32
    (whatever the inputs' dtype) and are identical on every rank of `group`; `group=None` (or a group of one)
    means the full vocabulary is local. Gradients reach `hidden` (this rank's share: sum them over the TP
    group, as Megatron's column-parallel layer does) and `weight`. Saved for backward: `hidden`, `weight` and
    three fp32 numbers per token.
    """
    if hidden.shape[:-1] != target.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and target {tuple(target.shape)} disagree: "
            "hidden must be target's shape plus h, weight (V/tp, h)"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    log_prob, entropy = _ChunkedLogProbEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1).long(), rank * weight.shape[0], group,
        float(temperature), chunk_tokens,
    )  # (N,) each
    return log_prob.reshape(target.shape), entropy.reshape(target.shape)
