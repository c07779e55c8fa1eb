"""KL divergence estimators between the policy and the reference, and KL-in-reward control.

Per-token estimators of KL(pi || pi_ref) from log-probs of the sampled token (Schulman's
k1/k2/k3 naming, verl's aliases):

- `kl` / `k1`: log pi - log pi_ref (unbiased, high variance, can be negative);
- `abs`: |log pi - log pi_ref|;
- `mse` / `k2`: 0.5 (log pi - log pi_ref)^2;
- `low_var_kl` / `k3`: r - log r - 1 with r = pi_ref / pi (non-negative, low variance); like
  verl, the log-ratio is clamped to [-20, 20] and the result to [-10, 10] so one outlier
  token cannot blow up the loss.

A `+` suffix (`k3+`, `low_var_kl+`, `k1+`, `abs+`, ...; verl's straight-through forms) keeps the
named estimator's value in the forward pass but takes the gradient of k2, 0.5 (log pi - log pi_ref)^2,
whose gradient (log pi - log pi_ref) * grad log pi is, on samples from pi, an unbiased estimate of the
gradient of KL(pi || pi_ref) (k1's and k3's are not). `k2+` / `mse+` are k2 itself.

`full` (exact KL over the vocabulary) needs full distributions, which the vocab-parallel
actor never gathers, so it is refused.

KL in the reward (the alternative to a KL loss): `apply_kl_penalty` subtracts beta * KL per
token from the token rewards, with beta from a fixed controller or the adaptive controller
of Ziegler et al. 2019 (the PPO-for-LM paper): beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n / horizon.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from recipe.algos.checks import check_same_shape
from recipe.algos.masked import masked_mean

_BASE_KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = (*_BASE_KL_KINDS, *(kind + "+" for kind in _BASE_KL_KINDS))


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate (same shape as the inputs) of the given `kind` (see module doc)."""
    check_same_shape("log_prob", log_prob, "ref_log_prob", ref_log_prob)
    diff = log_prob - ref_log_prob
    if kind.endswith("+") and kind[:-1] in _BASE_KL_KINDS:  # straight-through: this value, k2's gradient
        value = kl_penalty(log_prob, ref_log_prob, kind[:-1])
        k2 = 0.5 * diff.square()
        return k2 - k2.detach() + value.detach()
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = (-diff).clamp(-20.0, 20.0)  # log(pi_ref / pi)
        return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)
    if kind == "full":
        raise ValueError(
            "KL kind 'full' needs the whole vocabulary distribution, which the vocab-parallel actor "
            f"never gathers; use one of {KL_KINDS}"
        )
    raise ValueError(f"unknown KL kind {kind!r}; use one of {KL_KINDS}")


class KLController(Protocol):
    """Holds the KL coefficient beta used in the reward and updates it after each step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust beta given the measured mean KL over `n_steps` samples."""
        ...


class FixedKLController:
    """Constant beta."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Beta stays fixed."""


class AdaptiveKLController:
    """Beta driven towards a target KL (Ziegler et al. 2019, as in verl)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """beta *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


@dataclass
class KLControlConfig:
    """`algorithm.kl_ctrl.*`: how beta for KL in the reward is chosen."""

    type: str = "fixed"
    """Controller: "fixed" or "adaptive"."""
    kl_coef: float = 0.001
    """Beta (initial beta for "adaptive")."""
    target_kl: float = 0.1
    """Adaptive only: the KL that beta steers towards."""
    horizon: int = 10000
    """Adaptive only: samples over which beta moves by at most 20%."""

    def __post_init__(self) -> None:
        if self.type not in ("fixed", "adaptive"):
            raise ValueError(f"algorithm.kl_ctrl.type is {self.type!r}; use 'fixed' or 'adaptive'")
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef is {self.kl_coef}; it must be >= 0")
        if self.type == "adaptive" and self.target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl is {self.target_kl}; it must be > 0")
        if self.type == "adaptive" and self.horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon is {self.horizon}; it must be > 0")


def make_kl_controller(cfg: KLControlConfig) -> KLController:
    """Build the controller that `cfg.type` names."""
    if cfg.type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    return FixedKLController(cfg.kl_coef)


def apply_kl_penalty(
    token_rewards: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    controller: KLController,
    kind: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """Return token rewards minus beta * KL on sampled tokens, then update the controller.

    All tensors are (B, T). The controller sees the batch's mean (over samples) of each
    sample's token-mean KL, with n_steps = B. Metrics use verl's names.
    """
    check_same_shape("token_rewards", token_rewards, "response_mask", response_mask)
    check_same_shape("old_log_probs", old_log_probs, "response_mask", response_mask)
    check_same_shape("ref_log_probs", ref_log_probs, "response_mask", response_mask)
    mask = response_mask.bool()
    kld = torch.where(mask, kl_penalty(old_log_probs, ref_log_probs, kind), 0.0)  # (B, T)
    beta = controller.value
    rewards = token_rewards - beta * kld  # (B, T)
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean())
    controller.update(current_kl=current_kl, n_steps=token_rewards.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
