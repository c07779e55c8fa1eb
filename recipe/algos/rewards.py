"""Token-level rewards: where each reward of a multi-turn trajectory sits on the token axis.

A trajectory earns three kinds of reward: the outcome score of the whole answer, a step
reward per tool call, and a score per interaction (simulated-user) turn. Each is placed on
one response token and scaled by its own weight:

- outcome: on the last token the policy sampled (last position where response_mask is 1);
- tool and interaction rewards: at the end of the turn that earned them. The caller gives a
  response-token index for each (the trajectory's turn-end index); the reward is credited
  to the last *sampled* token at or before that index. So an index pointing at the end of a
  tool response or user message (mask 0) credits the assistant turn that triggered it.

Rewards never sit on mask-0 tokens: the estimators skip those tokens (see `advantages`), so a
reward there would be lost. Several rewards on the same token add up.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from recipe.algos.checks import check_2d, check_finite, check_mask_values

StepRewards = Sequence[Sequence[tuple[int, float]]]  # per sample: [(response token index, reward), ...]


def last_sampled_index(response_mask: Tensor) -> Tensor:
    """(B,) index of the last position where `response_mask` is 1; -1 for an empty row."""
    t = response_mask.shape[-1]
    positions = torch.arange(t, device=response_mask.device).expand_as(response_mask)  # (B, T)
    return torch.where(response_mask.bool(), positions, -1).max(dim=-1).values


def place_token_rewards(
    response_mask: Tensor,
    outcome: Tensor,
    tool_rewards: StepRewards | None = None,
    interaction_rewards: StepRewards | None = None,
    *,
    outcome_weight: float = 1.0,
    tool_weight: float = 1.0,
    interaction_weight: float = 1.0,
) -> Tensor:
    """Build (B, T) token rewards from per-sample outcome scores and per-turn step rewards.

    `response_mask` (B, T) is 1 on sampled tokens; `outcome` (B,) is each sample's outcome
    score; `tool_rewards[i]` / `interaction_rewards[i]` list `(token_index, reward)` pairs for
    sample i, indices on the response axis. Refuses empty responses, non-finite rewards and
    indices outside the response, naming the sample.
    """
    check_2d("response_mask", response_mask)
    check_mask_values("response_mask", response_mask)
    b, t = response_mask.shape
    if tuple(outcome.shape) != (b,):
        raise ValueError(
            f"outcome has shape {tuple(outcome.shape)} but response_mask has shape {(b, t)}; "
            f"outcome needs one score per sample, shape ({b},)"
        )
    check_finite("outcome reward", outcome)
    last = last_sampled_index(response_mask)  # (B,)
    empty = torch.nonzero(last < 0)
    if len(empty):
        raise ValueError(
            f"sample {int(empty[0, 0])} has no sampled response token (its response_mask row is all 0), "
            "so its reward has no token to sit on; drop empty responses before computing rewards"
        )
    rewards = torch.zeros((b, t), dtype=torch.float32, device=response_mask.device)  # (B, T)
    rows = torch.arange(b, device=response_mask.device)
    rewards[rows, last] = outcome_weight * outcome.to(rewards.dtype)

    positions = torch.arange(t, device=response_mask.device).expand_as(response_mask)  # (B, T)
    # prev_sampled[i, j]: last sampled position <= j in row i, or -1
    prev_sampled = torch.where(response_mask.bool(), positions, -1).cummax(dim=-1).values  # (B, T)
    for kind, weight, per_sample in (
        ("tool", tool_weight, tool_rewards),
        ("interaction", interaction_weight, interaction_rewards),
    ):
        if per_sample is None:
            continue
        if len(per_sample) != b:
            raise ValueError(f"{kind}_rewards has {len(per_sample)} entries but the batch has {b} samples")
        for i, steps in enumerate(per_sample):
            for index, value in steps:
                if not 0 <= index < t:
                    raise ValueError(
                        f"{kind} reward of sample {i} sits at token {index}, outside its response "
                        f"(0..{t - 1}); pass response-relative turn-end indices"
                    )
                if not math.isfinite(value):
                    raise ValueError(f"{kind} reward of sample {i} at token {index} is {value}; rewards must be finite")
                target = int(prev_sampled[i, index])
                if target < 0:
                    raise ValueError(
                        f"{kind} reward of sample {i} at token {index} comes before any sampled token; "
                        "a step reward must follow the assistant turn that earned it"
                    )
                rewards[i, target] += weight * float(value)
    return rewards
