"""The advantage estimators, by verl's names (`algorithm.adv_estimator`), each with what it needs.

An `EstimatorSpec` says what the run must build for an estimator (a critic, a greedy rollout of
each prompt) and which `AdvantageInputs` fields it reads; the config checks, the placement of
the roles and the trainer read these flags, never the estimator's name. The function is named by
dotted path and imported when first used, so this module (and the config checks that read it)
imports no torch. Adding an estimator: its function (e.g. in `recipe/algos/advantages.py`) and one
line here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.plugins import import_object


@dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator: its function and what it needs."""

    fn: str
    """Dotted path of `fn(AdvantageInputs, AlgorithmConfig) -> (advantages, returns)`, both (B, T)."""
    needs_critic: bool = False
    """Reads the critic's values: the run builds and trains a critic."""
    needs_greedy_rollout: bool = False
    """Reads each prompt's greedy-sample reward: the trainer rolls every prompt out once more, greedily, per step
    (needs a step's whole prompt batch, so not fully_async's streamed groups)."""
    inputs: tuple[str, ...] = ()
    """`AdvantageInputs` fields it reads beyond token_rewards and response_mask (index, values, reward_baselines)."""

    def load(self) -> Callable[..., Any]:
        """The estimator function."""
        return import_object(self.fn, f"the advantage estimator {self.fn}")


_A = "recipe.algos.advantages."
ADV_ESTIMATORS: dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(_A + "gae", needs_critic=True, inputs=("values",)),
    "grpo": EstimatorSpec(_A + "grpo", inputs=("index",)),
    "rloo": EstimatorSpec(_A + "rloo", inputs=("index",)),
    "reinforce_plus_plus": EstimatorSpec(_A + "reinforce_plus_plus"),
    "reinforce_plus_plus_baseline": EstimatorSpec(_A + "reinforce_plus_plus_baseline", inputs=("index",)),
    "remax": EstimatorSpec(_A + "remax", needs_greedy_rollout=True, inputs=("reward_baselines",)),
}
