"""Rewards, in one place: outcome scorers by data source (or verl's custom_reward_function), tool and
interaction rewards at their recorded turns, combined by the `reward.*` weights (see `scoring`).

`gsm8k` holds the GSM8K answer scorer that the outcome reward, the gsm8k tool and the gsm8k
interaction all use.
"""
from recipe.reward.scoring import (
    SCORERS,
    CustomRewardFunctionConfig,
    RewardConfig,
    RewardFn,
    RewardTerms,
    default_compute_score,
    load_compute_score,
    policy_text,
    register_scorer,
)

__all__ = [
    "SCORERS",
    "CustomRewardFunctionConfig",
    "RewardConfig",
    "RewardFn",
    "RewardTerms",
    "default_compute_score",
    "load_compute_score",
    "policy_text",
    "register_scorer",
]
