"""PPO policy and value losses, written so that parallel layout never changes the math.

The Megatron actor/critic call `policy_loss(mb, cfg)` / `value_loss(mb, cfg)` once per
micro-batch. Each returns this micro-batch's *share* of the mini-batch loss: summing the
returned losses over all micro-batches and data-parallel ranks gives the loss of the whole
mini-batch computed at once, exactly. That needs the mini-batch totals, which the caller
passes as `mb["global_token_count"]` (sampled tokens across all micro-batches and DP ranks)
and `mb["global_seq_count"]` (sequences, likewise). The caller must therefore *sum*
gradients over micro-batches and DP ranks (undo any averaging its DDP does, e.g. multiply by
the DP size when gradients are averaged).

Loss aggregation (`loss_agg_mode`, verl's names), with L[i,t] the per-token loss, m the
mask, N the global token count, S the global sequence count, n_i sequence i's tokens:
- `token-mean`:               sum_{i,t} m L / N
- `token-sum`:                sum_{i,t} m L                      (verl v0.9: no normalisation)
- `seq-mean-token-sum`:       sum_i (sum_t m L) / S
- `seq-mean-token-mean`:      sum_i (sum_t m L / n_i) / S       (an empty sequence adds 0)
- `seq-mean-token-sum-norm`:  sum_{i,t} m L / (S * H)           (Dr. GRPO; H = loss_scale_factor)
With no loss_scale_factor verl divides by the padded response width, which its agent loop pads to
rollout.response_length: `PPOConfig` fills H with that length, so a verl line trains the same here.
Departure from verl: verl normalises each micro-batch by its own sizes, so its result depends on how
the batch was split; here the denominators are global and H a fixed value.

Metrics follow the same rule: each is this micro-batch's share, and summing over
micro-batches and ranks gives the mini-batch value (token-weighted fractions and KL; loss
terms in the loss's own aggregation).

Policy loss: by default (`policy_loss.loss_mode=vanilla`) the PPO clipped surrogate with asymmetric
clip range [1 - clip_ratio_low, 1 + clip_ratio_high] ("clip-higher", DAPO) and dual-clip (Ye et al.
2020): for negative advantages the loss is capped at -A * clip_ratio_c. The log-ratio is clamped to
[-20, 20] before exp, as in verl. verl's other loss modes (gspo, gpg, clip_cov, kl_cov, geo_mean)
are in `policy_losses.py`, registered in `registry.py`. Plus an optional KL loss to the reference and
an entropy bonus, both aggregated with loss_agg_mode.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from recipe.algos.checks import check_2d, check_finite, check_same_shape
from recipe.algos.kl import KL_KINDS, kl_penalty
from recipe.algos.masked import masked_sum
from recipe.algos.registry import POLICY_LOSSES, POLICY_LOSSES_NOT_BUILT, load_policy_loss

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_agg(prefix: str, mode: str, loss_scale_factor: float | None) -> None:
    """Validate a loss_agg_mode and its horizon, naming the config keys."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"{prefix}.loss_agg_mode is {mode!r}; use one of {LOSS_AGG_MODES}")
    if loss_scale_factor is not None and loss_scale_factor <= 0:
        raise ValueError(f"{prefix}.loss_scale_factor is {loss_scale_factor}; give a horizon > 0, or null for "
                         "actor_rollout_ref.rollout.response_length (the padded width verl divides by)")


@dataclass
class PolicyLossModeConfig:
    """`actor_rollout_ref.actor.policy_loss.*`: which policy-gradient loss (verl's loss modes, `policy_losses.py`)
    and the settings of the modes that have some (verl's keys and defaults)."""

    loss_mode: str = "vanilla"
    """One of recipe.algos.registry.POLICY_LOSSES: vanilla (PPO), gspo, gpg, clip_cov, kl_cov, geo_mean."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of the sampled tokens whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens with covariance above this are candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: only tokens with covariance below this are candidates."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of the sampled tokens (largest covariance) that get the |log ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of that penalty."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.actor.policy_loss"
        if self.loss_mode in POLICY_LOSSES_NOT_BUILT:
            raise ValueError(f"{p}.loss_mode={self.loss_mode} is not built in polyturn: "
                             f"{POLICY_LOSSES_NOT_BUILT[self.loss_mode]}; use one of {sorted(POLICY_LOSSES)}")
        if self.loss_mode not in POLICY_LOSSES:
            raise ValueError(f"{p}.loss_mode is {self.loss_mode!r}; use one of {sorted(POLICY_LOSSES)}")
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise ValueError(f"{p}.{key} is {getattr(self, key)}; it must lie in (0, 1]")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"{p}.clip_cov_lb is {self.clip_cov_lb}, not below clip_cov_ub {self.clip_cov_ub}")
        if self.ppo_kl_coef < 0:
            raise ValueError(f"{p}.ppo_kl_coef is {self.ppo_kl_coef}; it must be >= 0")


@dataclass
class PolicyLossConfig:
    """`actor_rollout_ref.actor.*` keys that shape the policy loss."""

    clip_ratio_low: float = 0.2
    """The ratio's lower bound is 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """The ratio's upper bound is 1 + clip_ratio_high (raise it for clip-higher)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip cap for negative advantages (> 1); None disables."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one loss, one of LOSS_AGG_MODES (see the module docstring)."""
    loss_scale_factor: float | None = None
    """Horizon H of seq-mean-token-sum-norm; None: actor_rollout_ref.rollout.response_length (verl's padded
    response width), filled by PPOConfig."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(pi || pi_ref) to the loss."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss, one of KL_KINDS."""
    entropy_coeff: float = 0.0
    """Subtract entropy_coeff * entropy from the loss (needs mb["entropy"])."""
    policy_loss: PolicyLossModeConfig = field(default_factory=PolicyLossModeConfig)
    """The policy-gradient term's loss mode and its settings."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.actor"
        if isinstance(self.policy_loss, dict):  # built directly (tests, scripts) rather than by the config builder
            self.policy_loss = PolicyLossModeConfig(**self.policy_loss)
        if not 0.0 <= self.clip_ratio_low < 1.0:
            raise ValueError(f"{p}.clip_ratio_low is {self.clip_ratio_low}; it must lie in [0, 1)")
        if self.clip_ratio_high < 0.0:
            raise ValueError(f"{p}.clip_ratio_high is {self.clip_ratio_high}; it must be >= 0")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"{p}.clip_ratio_c is {self.clip_ratio_c}; dual-clip needs a value > 1 (or null to disable)")
        _check_agg(p, self.loss_agg_mode, self.loss_scale_factor)
        if self.kl_loss_type not in KL_KINDS:
            raise ValueError(f"{p}.kl_loss_type is {self.kl_loss_type!r}; use one of {KL_KINDS}")
        if self.kl_loss_coef < 0:
            raise ValueError(f"{p}.kl_loss_coef is {self.kl_loss_coef}; it must be >= 0")


@dataclass
class ValueLossConfig:
    """`critic.*` keys that shape the value loss."""

    cliprange_value: float = 0.5
    """New values may move at most this far from old values before clipping."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one loss, one of LOSS_AGG_MODES (see the module docstring)."""
    loss_scale_factor: float | None = None
    """Horizon H of seq-mean-token-sum-norm; None: actor_rollout_ref.rollout.response_length, as the actor's."""

    def __post_init__(self) -> None:
        if self.cliprange_value <= 0:
            raise ValueError(f"critic.cliprange_value is {self.cliprange_value}; it must be > 0")
        _check_agg("critic", self.loss_agg_mode, self.loss_scale_factor)


@dataclass
class PGInputs:
    """One micro-batch's inputs to a loss mode; every tensor is (B, T)."""

    log_probs: Tensor
    """Current policy's log-probs of the sampled tokens, with grad."""
    old_log_probs: Tensor
    """The behaviour (old) policy's log-probs."""
    advantages: Tensor
    """Per-token advantages."""
    mask: Tensor
    """response_mask: 1 on sampled tokens."""
    weights: Tensor | None
    """Rollout-correction weights (rollout_correction.py): detached, 0 on rejected tokens; None when off."""
    global_token_count: int
    """Sampled tokens in the mini-batch (all micro-batches and DP ranks)."""
    global_seq_count: int
    """Sequences in the mini-batch, likewise."""
    agg: Callable[[Tensor], Tensor]
    """The configured loss_agg_mode with the global denominators: (B, T) -> this micro-batch's share."""

    def log_ratio(self) -> Tensor:
        """log pi - log pi_old, clamped to [-20, 20] before any exp (as in verl). (B, T)"""
        return (self.log_probs - self.old_log_probs).clamp(-20.0, 20.0)

    def weighted(self, losses: Tensor) -> Tensor:
        """Per-token losses times the rollout-correction weights, when on. (B, T)"""
        return losses if self.weights is None else losses * self.weights

    def none(self) -> Tensor:
        """An all-False (B, T) mask (no token clipped)."""
        return torch.zeros_like(self.mask, dtype=torch.bool)


def _mask_and_counts(mb: dict[str, Any]) -> tuple[Tensor, int, int]:
    """Read and check mb's `response_mask` (B, T), `global_token_count` and `global_seq_count`."""
    if "response_mask" not in mb:
        raise ValueError(f"micro-batch lacks 'response_mask' (B, T); it has {sorted(mb)}")
    mask = mb["response_mask"]
    check_2d("response_mask", mask)
    counts = []
    for key in ("global_token_count", "global_seq_count"):
        if key not in mb:
            raise ValueError(f"micro-batch lacks {key!r}: the mini-batch total over all micro-batches and DP ranks")
        value = int(mb[key])
        if value <= 0:
            raise ValueError(f"micro-batch {key} is {value}; it must be > 0 (the mini-batch has no sampled tokens?)")
        counts.append(value)
    return mask, counts[0], counts[1]


def _tensors(mb: dict[str, Any], keys: tuple[str, ...], mask: Tensor) -> list[Tensor]:
    """Fetch (B, T) tensors from mb, each checked against response_mask's shape."""
    out = []
    for key in keys:
        if key not in mb:
            raise ValueError(f"micro-batch lacks {key!r} (B, T); it has {sorted(mb)}")
        check_same_shape(key, mb[key], "response_mask", mask)
        out.append(mb[key])
    return out


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    global_token_count: int,
    global_seq_count: int,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """This micro-batch's share of the mini-batch aggregate of (B, T) `loss_mat` (module doc)."""
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / global_token_count
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask) / global_seq_count
    if mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss_mat, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)  # (B,)
        return per_seq.sum() / global_seq_count
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            raise ValueError("seq-mean-token-sum-norm needs loss_scale_factor (PPOConfig fills it)")
        return masked_sum(loss_mat, mask) / (global_seq_count * loss_scale_factor)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; use one of {LOSS_AGG_MODES}")


def policy_loss(mb: dict[str, Any], cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """PPO policy loss share and metrics of one micro-batch (see module doc for the contract).

    mb: `log_probs` (B, T) with grad, `old_log_probs`, `advantages`, `response_mask` (B, T),
    optional `entropy`, `ref_log_probs`, `rollout_is_weights` (B, T); ints `global_token_count`, `global_seq_count`.
    The policy-gradient term is cfg.policy_loss.loss_mode's (policy_losses.py; clip fractions as defined there).
    Metrics: pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, and entropy / kl_loss when present.
    """
    mask, n_tok, n_seq = _mask_and_counts(mb)
    log_probs, old_log_probs, advantages = _tensors(mb, ("log_probs", "old_log_probs", "advantages"), mask)
    check_finite("advantage", advantages, mask, where="micro-batch row")
    check_finite("old_log_probs", old_log_probs, mask, where="micro-batch row")

    def agg(x: Tensor) -> Tensor:
        return agg_loss(x, mask, cfg.loss_agg_mode, n_tok, n_seq, cfg.loss_scale_factor)

    inputs = PGInputs(log_probs, old_log_probs, advantages, mask, mb.get("rollout_is_weights"), n_tok, n_seq, agg)
    pg_loss, clipped, dual_clipped = load_policy_loss(cfg.policy_loss.loss_mode)(inputs, cfg)
    log_ratio = inputs.log_ratio()  # (B, T)
    loss = pg_loss

    def token_share(x: Tensor) -> Tensor:  # token-weighted share of a mini-batch mean
        return masked_sum(x.to(log_ratio.dtype), mask) / n_tok

    names = ["pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"]
    values = [pg_loss, token_share(clipped), token_share(dual_clipped), token_share(-log_ratio)]
    if cfg.entropy_coeff != 0 and "entropy" not in mb:
        raise ValueError(
            f"actor_rollout_ref.actor.entropy_coeff is {cfg.entropy_coeff} but the micro-batch lacks 'entropy'; "
            "compute entropy in the forward pass or set entropy_coeff=0"
        )
    if "entropy" in mb:
        (entropy,) = _tensors(mb, ("entropy",), mask)
        entropy_agg = agg(entropy)
        loss = loss - cfg.entropy_coeff * entropy_agg
        names.append("entropy")
        values.append(entropy_agg)
    if cfg.use_kl_loss:
        if "ref_log_probs" not in mb:
            raise ValueError(
                "actor_rollout_ref.actor.use_kl_loss is true but the micro-batch lacks 'ref_log_probs'; "
                "compute reference log-probs first or set use_kl_loss=false"
            )
        (ref_log_probs,) = _tensors(mb, ("ref_log_probs",), mask)
        kl_loss = agg(kl_penalty(log_probs, ref_log_probs, cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl_loss
        names.append("kl_loss")
        values.append(kl_loss)
    metrics = dict(zip(names, torch.stack([v.detach().float() for v in values]).tolist()))
    return loss, metrics


def value_loss(mb: dict[str, Any], cfg: ValueLossConfig) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss share and metrics of one micro-batch (PPO2-style, as in verl).

    mb: `values` (B, T) with grad, `old_values`, `returns`, `response_mask` (B, T); ints
    `global_token_count`, `global_seq_count`. Loss: 0.5 * agg(max((v - R)^2, (v_clip - R)^2))
    with v_clip = old + clamp(v - old, +-cliprange_value). Metrics: vf_loss, vf_clipfrac, vpred_mean.
    """
    mask, n_tok, n_seq = _mask_and_counts(mb)
    values, old_values, returns = _tensors(mb, ("values", "old_values", "returns"), mask)
    check_finite("return", returns, mask, where="micro-batch row")
    check_finite("old value", old_values, mask, where="micro-batch row")
    clipped_values = old_values + (values - old_values).clamp(-cfg.cliprange_value, cfg.cliprange_value)
    loss_unclipped = (values - returns).square()  # (B, T)
    loss_clipped = (clipped_values - returns).square()  # (B, T)
    vf_loss = 0.5 * agg_loss(
        torch.maximum(loss_unclipped, loss_clipped), mask, cfg.loss_agg_mode, n_tok, n_seq, cfg.loss_scale_factor
    )
    clipfrac = masked_sum((loss_clipped > loss_unclipped).to(values.dtype), mask) / n_tok
    vpred_mean = masked_sum(values, mask) / n_tok
    metrics = dict(
        zip(("vf_loss", "vf_clipfrac", "vpred_mean"), torch.stack([vf_loss.detach(), clipfrac, vpred_mean.detach()]).tolist())
    )
    return vf_loss, metrics
