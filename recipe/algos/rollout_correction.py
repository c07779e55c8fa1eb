"""Rollout correction (`algorithm.rollout_correction.*`, verl's keys and meaning): weigh each sampled token by
how far the trainer's policy has drifted from the engine that sampled it.

The engine samples with its own kernels (bf16, a different attention, or older weights under an async
schedule), so its log-prob of a token, `rollout_log_probs`, differs from the trainer's `old_log_probs`.
The PPO ratio is taken against `old_log_probs`; the importance weight `pi_old / pi_engine` corrects for the
distribution the tokens actually came from:

- `rollout_is` (truncated IS, TIS): `token`: `w_t = min(exp(old_t - rollout_t), rollout_is_threshold)`;
  `sequence`: one weight per sample, `min(exp(sum_t (old_t - rollout_t)), threshold)`, on all its tokens.
- `rollout_rs` (masked IS, MIS: rejection): tokens (`token`), whole samples by their summed log-ratio
  (`sequence`) or by its per-token mean (`geometric`) whose ratio lies outside
  `[rollout_rs_threshold_lower, rollout_rs_threshold]` get weight 0. The lower bound defaults to
  `1 / rollout_rs_threshold`.
- `rollout_token_veto_threshold`: a sample holding any token whose ratio is below it gets weight 0.

The result is one `(B, T)` weight, detached, that `losses.policy_loss` multiplies into the per-token policy
loss. Where it departs from verl: a rejected token keeps its place in the loss's token count (weight 0
instead of dropping it from `response_mask`), so no sample ever becomes empty. Log-ratios are clamped to
[-20, 20] before `exp`, verl's safety bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recipe.algos.checks import check_2d, check_finite, check_same_shape
from recipe.algos.masked import masked_mean

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
_BOUND = 20.0


@dataclass
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction.*`: importance weights of the engine's samples (off by default)."""

    rollout_is: str | None = None
    """Truncated importance sampling: None (off), "token" or "sequence"."""
    rollout_is_threshold: float = 2.0
    """Upper clamp of the IS weight (verl's default)."""
    rollout_rs: str | None = None
    """Rejection (masked IS): None (off), "token", "sequence" or "geometric"."""
    rollout_rs_threshold: float | None = None
    """Upper bound of the accepted ratio; required when rollout_rs is set."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the accepted ratio; None: 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float | None = None
    """Reject a whole sample when one of its tokens has a ratio below this; None: off."""

    def __post_init__(self) -> None:
        key = "algorithm.rollout_correction"
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"{key}.rollout_is is {self.rollout_is!r}; use null or one of {IS_LEVELS}")
        if self.rollout_rs is not None and self.rollout_rs not in RS_LEVELS:
            raise ValueError(f"{key}.rollout_rs is {self.rollout_rs!r}; use null or one of {RS_LEVELS}")
        if self.rollout_is_threshold <= 0:
            raise ValueError(f"{key}.rollout_is_threshold is {self.rollout_is_threshold}; it must be > 0")
        if self.rollout_rs is not None:
            if self.rollout_rs_threshold is None or self.rollout_rs_threshold <= 0:
                raise ValueError(f"{key}.rollout_rs={self.rollout_rs} needs rollout_rs_threshold > 0 "
                                 f"(got {self.rollout_rs_threshold}); e.g. rollout_rs_threshold=2.0")
            if not 0 < self.lower < self.rollout_rs_threshold:
                raise ValueError(f"{key}.rollout_rs_threshold_lower is {self.lower}; it must lie in "
                                 f"(0, rollout_rs_threshold={self.rollout_rs_threshold})")
        if self.rollout_token_veto_threshold is not None and self.rollout_token_veto_threshold <= 0:
            raise ValueError(f"{key}.rollout_token_veto_threshold is {self.rollout_token_veto_threshold}; "
                             "it must be > 0 (or null)")

    @property
    def enabled(self) -> bool:
        return any(x is not None for x in (self.rollout_is, self.rollout_rs, self.rollout_token_veto_threshold))

    @property
    def lower(self) -> float:
        """The accepted ratio's lower bound."""
        if self.rollout_rs_threshold_lower is not None:
            return self.rollout_rs_threshold_lower
        return 1.0 / self.rollout_rs_threshold if self.rollout_rs_threshold else 0.0


def rollout_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor,
                    cfg: RolloutCorrectionConfig) -> tuple[Tensor, dict[str, float]]:
    """`(B, T)` inputs -> `(weights (B, T), metrics)`: the per-token weight of the policy loss (0 off the mask)
    and `rollout_corr/*` metrics (IS weight statistics before truncation, truncated and rejected fractions)."""
    for name, t in (("old_log_probs", old_log_probs), ("rollout_log_probs", rollout_log_probs)):
        check_2d(name, t)
        check_same_shape(name, t, "response_mask", response_mask)
    mask = response_mask.bool()  # (B, T)
    check_finite("rollout_log_probs", rollout_log_probs, mask)
    log_ratio = torch.where(mask, old_log_probs - rollout_log_probs, torch.zeros_like(old_log_probs))  # (B, T)
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True)  # (B, 1)
    n_tok = mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    token_ratio = log_ratio.clamp(-_BOUND, _BOUND).exp()  # (B, T)
    weights = mask.float()  # (B, T)
    metrics: dict[str, float] = {}
    if cfg.rollout_is is not None:
        raw = token_ratio if cfg.rollout_is == "token" else seq_log_ratio.clamp(-_BOUND, _BOUND).exp().expand_as(mask)
        sel = raw[mask]
        metrics.update({
            "rollout_corr/rollout_is_mean": float(sel.mean()), "rollout_corr/rollout_is_max": float(sel.max()),
            "rollout_corr/rollout_is_min": float(sel.min()),
            "rollout_corr/rollout_is_std": float(sel.std()) if sel.numel() > 1 else 0.0,
            "rollout_corr/rollout_is_ratio_fraction_high": float((sel > cfg.rollout_is_threshold).float().mean()),
            # Kish's effective sample size of the truncated weights, as a fraction of the tokens
            "rollout_corr/rollout_is_eff_sample_size": float(
                sel.clamp(max=cfg.rollout_is_threshold).sum() ** 2
                / (sel.clamp(max=cfg.rollout_is_threshold).square().sum() * sel.numel())),
        })
        weights = weights * raw.clamp(max=cfg.rollout_is_threshold)
    accept = mask.clone()  # (B, T)
    if cfg.rollout_rs is not None:
        lo, hi = cfg.lower, cfg.rollout_rs_threshold
        level = {"token": log_ratio, "sequence": seq_log_ratio, "geometric": seq_log_ratio / n_tok}[cfg.rollout_rs]
        ratio = level.clamp(-_BOUND, _BOUND).exp()
        accept &= (ratio >= lo) & (ratio <= hi)
    if cfg.rollout_token_veto_threshold is not None:
        vetoed = (mask & (token_ratio < cfg.rollout_token_veto_threshold)).any(dim=1, keepdim=True)  # (B, 1)
        accept &= ~vetoed
        metrics["rollout_corr/rollout_veto_fraction"] = float(vetoed.float().mean())
    if cfg.rollout_rs is not None or cfg.rollout_token_veto_threshold is not None:
        metrics["rollout_corr/rollout_rs_masked_fraction"] = float(1.0 - masked_mean(accept.float(), mask))
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float(((mask & ~accept).any(dim=1)).float().mean())
        weights = weights * accept.float()
    return weights.detach(), metrics
