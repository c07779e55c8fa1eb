"""Advantage estimators, by verl's names (`algorithm.adv_estimator`; declared in `recipe.algos.registry`).

Each estimator maps `AdvantageInputs` (token rewards (B, T), response mask, and what its
registry entry says it reads: group ids, values, baselines) to `(advantages, returns)`, both
(B, T) and zero where the mask is 0. `compute_advantage` checks the inputs before it calls one.

Multi-turn trajectories: tool and user tokens inside a response have mask 0. Every
recursion over the token axis *jumps over* them, as if they were not there: no reward is
read, no discount applied and no value bootstrapped at a mask-0 token (this is verl's
multi-turn GAE). So the last token of one assistant turn bootstraps from the first token of
the next assistant turn. Rewards on mask-0 tokens are refused (they would be lost).

Departures from the textbook / verl:
- `grpo`, `rloo`, `reinforce_plus_plus_baseline`: a group of size 1 (a prompt with one
  sample) has no comparison, so its advantage is 0 (verl keeps the raw score for such
  groups in grpo/rloo). GRPO's std is the unbiased (Bessel) std, as in verl.
- `reinforce_plus_plus`: the discounted return jumps over mask-0 tokens like GAE (verl
  resets it at mask-0 tokens, which cuts credit between turns).
- whitening (gae, reinforce_plus_plus*) is global over the batch's sampled tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from recipe.algos.checks import check_2d, check_finite, check_mask_values, check_same_shape
from recipe.algos.kl import KL_KINDS, KLControlConfig
from recipe.algos.masked import masked_whiten
from recipe.algos.registry import ADV_ESTIMATORS
from recipe.algos.rollout_correction import RolloutCorrectionConfig


@dataclass
class AdvantageInputs:
    """What the estimators read; fields an estimator does not need may be None."""

    token_rewards: Tensor  # (B, T) rewards on sampled tokens (see place_token_rewards), 0 elsewhere
    response_mask: Tensor  # (B, T) 1 on tokens the policy sampled
    index: Sequence[Hashable] | None = None  # (B,) group id (prompt uid): grpo, rloo, reinforce_plus_plus_baseline
    values: Tensor | None = None  # (B, T) critic values of the old policy: gae
    reward_baselines: Tensor | None = None  # (B,) reward of a greedy sample of the same prompt: remax


FILTER_METRICS = ("acc", "score", "seq_reward")


@dataclass
class FilterGroupsConfig:
    """`algorithm.filter_groups.*`: dynamic sampling (DAPO's filter, verl's keys). A group whose samples all score the
    same carries no signal to a group-relative estimator: it is dropped, and more prompt batches are rolled out until
    the step holds `data.train_batch_size` groups that differ."""

    enable: bool = False
    """Drop groups with no spread in `metric` and refill the batch."""
    metric: str | None = None
    """What must differ inside a group: "acc" (the scorer's `acc` key), "score" (the outcome score) or "seq_reward"
    (the weighted total reward); required when enabled."""
    max_num_gen_batches: int = 0
    """Prompt batches rolled out per step at most, the first included; 0: no limit (verl's meaning). A step that
    reaches the limit with fewer than data.train_batch_size groups stops the run (as verl does)."""

    def __post_init__(self) -> None:
        if self.enable and self.metric not in FILTER_METRICS:
            raise ValueError(f"algorithm.filter_groups.metric is {self.metric!r}; with filter_groups.enable=true use "
                             f"one of {FILTER_METRICS}")
        if self.max_num_gen_batches < 0:
            raise ValueError(f"algorithm.filter_groups.max_num_gen_batches is {self.max_num_gen_batches}; it must be "
                             ">= 0 (0: no limit)")


@dataclass
class AlgorithmConfig:
    """`algorithm.*`: advantage estimator, KL in the reward and rollout correction (verl's keys)."""

    adv_estimator: str = "grpo"
    """Advantage estimator, one of recipe.algos.registry.ADV_ESTIMATORS (gae needs the critic, remax a greedy rollout
    per prompt)."""
    gamma: float = 1.0
    """Discount over sampled tokens (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    epsilon: float = 1e-6
    """GRPO: added to the group std."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(old || ref) from token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the reward penalty, one of KL_KINDS."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """How beta of the KL-in-reward penalty is chosen."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights of the engine's samples against the trainer's old log-probs (TIS / MIS)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling: groups without a reward spread dropped, the batch refilled."""

    def __post_init__(self) -> None:
        if isinstance(self.kl_ctrl, dict):
            self.kl_ctrl = KLControlConfig(**self.kl_ctrl)
        if isinstance(self.rollout_correction, dict):
            self.rollout_correction = RolloutCorrectionConfig(**self.rollout_correction)
        if isinstance(self.filter_groups, dict):
            self.filter_groups = FilterGroupsConfig(**self.filter_groups)
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator is {self.adv_estimator!r}; use one of {sorted(ADV_ESTIMATORS)}"
            )
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"algorithm.{key} is {getattr(self, key)}; it must lie in [0, 1]")
        if self.epsilon <= 0:
            raise ValueError(f"algorithm.epsilon is {self.epsilon}; it must be > 0")
        if self.kl_penalty not in KL_KINDS:
            raise ValueError(f"algorithm.kl_penalty is {self.kl_penalty!r}; use one of {KL_KINDS}")


def _check_inputs(inputs: AdvantageInputs, name: str, needs: tuple[str, ...]) -> None:
    """Shapes agree, rewards finite and only on sampled tokens; the inputs estimator `name` reads are present."""
    check_2d("response_mask", inputs.response_mask)
    check_mask_values("response_mask", inputs.response_mask)
    check_same_shape("token_rewards", inputs.token_rewards, "response_mask", inputs.response_mask)
    check_finite("token reward", inputs.token_rewards)
    stray = (inputs.token_rewards != 0) & ~inputs.response_mask.bool()
    if bool(stray.any()):
        row, col = (int(v) for v in torch.nonzero(stray)[0])
        raise ValueError(
            f"sample {row} has reward {inputs.token_rewards[row, col].item()} at token {col}, where response_mask "
            "is 0; rewards must sit on sampled tokens (use place_token_rewards)"
        )
    b = inputs.response_mask.shape[0]
    if "index" in needs and (inputs.index is None or len(inputs.index) != b):
        got = None if inputs.index is None else len(inputs.index)
        raise ValueError(f"{name} needs index (one group id per sample, {b}), got {got}")
    if "values" in needs:
        if inputs.values is None:
            raise ValueError(f"{name} needs values (B, T) from the critic; enable the critic or pick grpo")
        check_same_shape("values", inputs.values, "response_mask", inputs.response_mask)
        check_finite("value", inputs.values, inputs.response_mask)
    if "reward_baselines" in needs:
        if inputs.reward_baselines is None or tuple(inputs.reward_baselines.shape) != (b,):
            got = None if inputs.reward_baselines is None else tuple(inputs.reward_baselines.shape)
            raise ValueError(f"{name} needs reward_baselines of shape ({b},), got {got}")
        check_finite("reward baseline", inputs.reward_baselines)


def _group_ids(index: Sequence[Hashable], device: torch.device) -> Tensor:
    """(B,) dense group number for each sample's group id."""
    if isinstance(index, Tensor):
        index = index.tolist()
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(uid, len(numbers)) for uid in index], device=device)


def _group_stats(scores: Tensor, gid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group size, group sum, unbiased group std) for (B,) scores."""
    n_groups = int(gid.max()) + 1
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, gid, torch.ones_like(scores))  # (G,)
    total = zeros.index_add(0, gid, scores)  # (G,)
    dev = scores - (total / count)[gid]  # (B,)
    var = zeros.index_add(0, gid, dev.square()) / (count - 1).clamp(min=1)  # (G,)
    return count[gid], total[gid], var.sqrt()[gid]


def _reverse_scan(x: Tensor, mask: Tensor, step: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Right-to-left scan over sampled tokens: carry = step(x[:, t], carry) where mask is 1.

    At mask-0 tokens the carry passes through unchanged (multi-turn jump). Returns (B, T)
    with the carry after each position.
    """
    carry = torch.zeros_like(x[:, 0])  # (B,)
    out = torch.zeros_like(x)  # (B, T)
    m = mask.bool()
    for t in reversed(range(x.shape[1])):
        carry = torch.where(m[:, t], step(x[:, t], carry), carry)
        out[:, t] = carry
    return out


def gae(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lambda) over sampled tokens; returns = advantages + values; advantages whitened.

    delta_t = r_t + gamma V_next - V_t and A_t = delta_t + gamma lambda A_next, where "next"
    is the next *sampled* token (0 after the last one).
    """
    rewards, mask, values = inputs.token_rewards, inputs.response_mask, inputs.values
    b, t_len = rewards.shape
    next_value = torch.zeros(b, dtype=values.dtype, device=values.device)  # (B,)
    next_adv = torch.zeros_like(next_value)  # (B,)
    advantages = torch.zeros_like(values)  # (B, T)
    m = mask.bool()
    for t in reversed(range(t_len)):
        delta = rewards[:, t] + cfg.gamma * next_value - values[:, t]
        adv_t = delta + cfg.gamma * cfg.lam * next_adv
        next_adv = torch.where(m[:, t], adv_t, next_adv)
        next_value = torch.where(m[:, t], values[:, t], next_value)
        advantages[:, t] = next_adv
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    returns = torch.where(m, advantages + values, zero)
    advantages = torch.where(m, masked_whiten(advantages, mask), zero)
    return advantages, returns


def _outcome_scores(inputs: AdvantageInputs) -> Tensor:
    """(B,) total reward of each sample."""
    return inputs.token_rewards.sum(dim=-1)


def grpo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """(score - group mean) [/ (group std + epsilon)], broadcast to every sampled token."""
    scores = _outcome_scores(inputs)  # (B,)
    count, total, std = _group_stats(scores, _group_ids(inputs.index, scores.device))
    adv = scores - total / count  # a singleton is its own mean: 0
    if cfg.norm_adv_by_std_in_grpo:
        adv = adv / (std + cfg.epsilon)
    adv = adv.unsqueeze(-1) * inputs.response_mask  # (B, T)
    return adv, adv


def rloo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Score minus the mean score of the *other* samples of the group (leave-one-out)."""
    scores = _outcome_scores(inputs)  # (B,)
    count, total, _ = _group_stats(scores, _group_ids(inputs.index, scores.device))
    adv = torch.where(count > 1, scores - (total - scores) / (count - 1).clamp(min=1), 0.0)  # singleton: 0
    adv = adv.unsqueeze(-1) * inputs.response_mask  # (B, T)
    return adv, adv


def reinforce_plus_plus(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Discounted return-to-go over sampled tokens, whitened over the batch (REINFORCE++)."""
    mask = inputs.response_mask
    returns = _reverse_scan(inputs.token_rewards, mask, lambda r, g: r + cfg.gamma * g)  # (B, T)
    returns = returns * mask
    return masked_whiten(returns, mask) * mask, returns


def reinforce_plus_plus_baseline(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Score minus group mean, broadcast to tokens, then whitened over the batch."""
    scores = _outcome_scores(inputs)  # (B,)
    count, total, _ = _group_stats(scores, _group_ids(inputs.index, scores.device))
    centred = scores - total / count  # a singleton is its own mean: 0
    mask = inputs.response_mask
    tokens = centred.unsqueeze(-1) * mask  # (B, T)
    adv = masked_whiten(tokens, mask) * mask
    return adv, adv


def remax(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Undiscounted return-to-go minus the greedy sample's reward (ReMax)."""
    mask = inputs.response_mask
    returns = _reverse_scan(inputs.token_rewards, mask, lambda r, g: r + g) * mask  # (B, T)
    adv = (returns - inputs.reward_baselines.unsqueeze(-1)) * mask
    return adv, returns


def compute_advantage(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Run the estimator `cfg.adv_estimator` names on checked inputs; returns (advantages, returns), both (B, T)."""
    spec = ADV_ESTIMATORS[cfg.adv_estimator]
    _check_inputs(inputs, cfg.adv_estimator, spec.inputs)
    advantages, returns = spec.load()(inputs, cfg)
    check_finite("advantage", advantages, inputs.response_mask)
    return advantages, returns
