"""The policy-gradient loss modes (`actor_rollout_ref.actor.policy_loss.loss_mode`, verl's names).

Each mode is one function `mode(x: PGInputs, cfg: PolicyLossConfig) -> (pg_loss, clipped, clipped_lower)`:
`pg_loss` is this micro-batch's share of the mini-batch policy-gradient loss (the summing contract of
`losses.py`), `clipped` / `clipped_lower` are (B, T) bool masks that become the `pg_clipfrac` /
`pg_clipfrac_lower` metrics. For every mode, `pg_clipfrac` is the fraction of sampled tokens whose
gradient the mode's trust region cuts (or, for kl_cov, penalises), and `pg_clipfrac_lower` the
fraction dual-clipped (only vanilla has dual-clip; 0 elsewhere). The registry
(`recipe.algos.registry.POLICY_LOSSES`) names each function by dotted path.

With r = exp(log pi - log pi_old) per token (log-ratio clamped to [-20, 20]), A the advantage, and
[1 - lo, 1 + hi] the clip range from clip_ratio_low / clip_ratio_high:

- `vanilla`: PPO, max(-A r, -A clip(r)), dual-clip capped at -A * clip_ratio_c for A < 0.
- `gspo` (Zheng et al. 2025, GSPO): one ratio per sequence, s_i = exp(mean over its tokens of log r),
  clipped like PPO and always aggregated seq-mean-token-mean (the paper's objective; loss_agg_mode is
  not used). Written per token as in verl's "GSPO-token": token t carries the value s_i and the
  gradient of log pi_t, so with a sequence-level advantage the gradient is the paper's. Its log is
  clamped to at most 10, as in verl. No dual-clip.
- `gpg` (Chu et al. 2025, GPG): the plain policy gradient -A log pi, no ratio, no clipping.
- `clip_cov` (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): PPO clipping, and a
  random clip_cov_ratio fraction of the tokens whose centred covariance (A - mean A)(log pi - mean
  log pi) lies in (clip_cov_lb, clip_cov_ub) lose their gradient (loss 0). No dual-clip.
- `kl_cov` (same paper): unclipped -A r, plus ppo_kl_coef * |log r| on the kl_cov_ratio fraction of
  tokens with the largest covariance. No dual-clip.
- `geo_mean` (GMPO, Zhao et al. 2025): per token the log-ratio clipped to [-lo, hi] on the
  pessimistic side for sign(A); the sequence ratio is the exp of their mean (geometric mean of the
  ratios), the loss -mean(A) * ratio per sequence, averaged over sequences (loss_agg_mode not used).
  Rollout-correction weights enter as their geometric mean per sequence.

Departure from the micro-batch invariance of `losses.py`: clip_cov and kl_cov take the covariance's
means and their token fraction within each micro-batch (as verl does), so their result depends on how
the mini-batch is split; the other modes are exact under any split.
"""
from __future__ import annotations

import torch
from torch import Tensor

from recipe.algos.losses import PGInputs, PolicyLossConfig, agg_loss
from recipe.algos.masked import masked_mean, masked_sum

PGResult = tuple[Tensor, Tensor, Tensor]
"""(pg_loss share, clipped (B, T) bool, dual-clipped (B, T) bool)."""


def _ppo_clip(ratio: Tensor, advantages: Tensor, cfg: PolicyLossConfig) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic max(-A r, -A clip(r)) per token and where the clip won (cut the gradient). Both (B, T)."""
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)  # (B, T)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def vanilla(x: PGInputs, cfg: PolicyLossConfig) -> PGResult:
    """PPO clipped surrogate with clip-higher and dual-clip (see losses.py's module doc)."""
    losses, clipped = _ppo_clip(x.log_ratio().exp(), x.advantages, cfg)
    dual_clipped = x.none()
    if cfg.clip_ratio_c is not None:
        cap = -x.advantages * cfg.clip_ratio_c  # (B, T)
        dual_clipped = (x.advantages < 0) & (losses > cap)
        losses = torch.where(dual_clipped, cap, losses)
    return x.agg(x.weighted(losses)), clipped, dual_clipped


def gspo(x: PGInputs, cfg: PolicyLossConfig) -> PGResult:
    """GSPO: the sequence's geometric-mean ratio, PPO-clipped, aggregated seq-mean-token-mean."""
    n_i = x.mask.sum(dim=-1).clamp(min=1)  # (B,) sampled tokens of each sequence
    seq_log_ratio = masked_sum(x.log_probs - x.old_log_probs, x.mask, dim=-1) / n_i  # (B,) log s_i
    # value log s_i on every token, gradient d log pi_t: (B, T)
    token_log_ratio = x.log_probs - x.log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    losses, clipped = _ppo_clip(token_log_ratio.clamp(-20.0, 10.0).exp(), x.advantages, cfg)
    loss = agg_loss(x.weighted(losses), x.mask, "seq-mean-token-mean", x.global_token_count, x.global_seq_count)
    return loss, clipped, x.none()


def gpg(x: PGInputs, cfg: PolicyLossConfig) -> PGResult:
    """GPG: -A log pi per token, the configured aggregation; nothing is clipped."""
    return x.agg(x.weighted(-x.advantages * x.log_probs)), x.none(), x.none()


def _centred_cov(x: PGInputs) -> Tensor:
    """(A - mean A) * (log pi - mean log pi) per token, means over this micro-batch's sampled tokens, detached. (B, T)"""
    log_probs = x.log_probs.detach()
    return (x.advantages - masked_mean(x.advantages, x.mask)) * (log_probs - masked_mean(log_probs, x.mask))


def clip_cov(x: PGInputs, cfg: PolicyLossConfig) -> PGResult:
    """Clip-Cov: PPO clipping, plus a random few tokens of moderately high covariance lose their gradient."""
    pl = cfg.policy_loss
    losses, ratio_clipped = _ppo_clip(x.log_ratio().exp(), x.advantages, cfg)
    sampled = x.mask.bool()  # (B, T)
    cov = _centred_cov(x)  # (B, T)
    eligible = sampled & ~ratio_clipped & (cov > pl.clip_cov_lb) & (cov < pl.clip_cov_ub)  # (B, T)
    candidates = eligible.flatten().nonzero().squeeze(-1)  # (K,) flat positions
    n_cut = max(int(pl.clip_cov_ratio * int(sampled.sum())), 1)
    chosen = candidates[torch.randperm(candidates.numel(), device=candidates.device)[:n_cut]]
    cut = torch.zeros(sampled.numel(), dtype=torch.bool, device=sampled.device)
    cut[chosen] = True
    cut = cut.view_as(sampled)  # (B, T)
    losses = torch.where(cut, torch.zeros_like(losses), losses)
    return x.agg(x.weighted(losses)), (ratio_clipped & sampled) | cut, x.none()


def kl_cov(x: PGInputs, cfg: PolicyLossConfig) -> PGResult:
    """KL-Cov: the unclipped surrogate, plus a |log r| penalty on the tokens of largest covariance."""
    pl = cfg.policy_loss
    log_ratio = x.log_ratio()  # (B, T)
    losses = -x.advantages * log_ratio.exp()  # (B, T)
    sampled = x.mask.bool()
    n_sampled = int(sampled.sum())
    penalised = x.none()
    if n_sampled > 0:
        cov = torch.where(sampled, _centred_cov(x), float("-inf")).flatten()  # (B*T,)
        top = torch.topk(cov, max(1, int(n_sampled * pl.kl_cov_ratio))).indices
        penalised = penalised.flatten().index_fill(0, top, True).view_as(sampled)  # (B, T)
    losses = losses + torch.where(penalised, pl.ppo_kl_coef * log_ratio.abs(), torch.zeros_like(losses))
    return x.agg(x.weighted(losses)), penalised, x.none()


def geo_mean(x: PGInputs, cfg: PolicyLossConfig) -> PGResult:
    """GMPO: geometric mean of the token ratios per sequence, clipped per token in log space."""
    log_ratio = x.log_ratio()  # (B, T)
    sign = x.advantages.sign()  # (B, T)
    bounded = log_ratio.clamp(-cfg.clip_ratio_low, cfg.clip_ratio_high)  # (B, T)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)  # (B, T)
    n_i = x.mask.sum(dim=-1).clamp(min=1)  # (B,)
    seq_ratio = (masked_sum(pessimistic, x.mask, dim=-1) / n_i).exp()  # (B,)
    seq_adv = masked_sum(x.advantages, x.mask, dim=-1) / n_i  # (B,)
    losses = -seq_adv * seq_ratio  # (B,)
    if x.weights is not None:  # geometric mean of the weights; a rejected token (0) all but zeroes its sequence
        losses = losses * (masked_sum((x.weights + 1e-10).log(), x.mask, dim=-1) / n_i).exp()
    cut = x.mask.bool() & (sign * bounded < sign * log_ratio)  # (B, T) the clip took the token's gradient
    return losses.sum() / x.global_seq_count, cut, x.none()
