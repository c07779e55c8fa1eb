"""Rewards, in one place: outcome scorers by data source (the tasks' in recipe/tasks/, or verl's
custom_reward_function), tool and interaction rewards at their recorded turns, combined by the `reward.*`
weights (see `scoring`).
"""
from recipe.reward.scoring import (
    CustomRewardFunctionConfig,
    RewardConfig,
    RewardFn,
    RewardTerms,
    load_compute_score,
    policy_text,
    task_compute_score,
)

__all__ = [
    "CustomRewardFunctionConfig",
    "RewardConfig",
    "RewardFn",
    "RewardTerms",
    "load_compute_score",
    "policy_text",
    "task_compute_score",
]
