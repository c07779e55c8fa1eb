"""The advantage estimators and policy-loss modes, by verl's names, each with what it needs.

Advantage estimators (`algorithm.adv_estimator`):
An `EstimatorSpec` says what the run must build for an estimator (a critic, a greedy rollout of
each prompt) and which `AdvantageInputs` fields it reads; the config checks, the placement of
the roles and the trainer read these flags, never the estimator's name. The function is named by
dotted path and imported when first used, so this module (and the config checks that read it)
imports no torch. Adding an estimator: its function (e.g. in `recipe/algos/advantages.py`) and one
line here.

Policy-loss modes (`actor_rollout_ref.actor.policy_loss.loss_mode`): `POLICY_LOSSES` names each mode's
function (signature in `recipe/algos/policy_losses.py`) by dotted path, loaded the same way; verl's modes
not built here are in `POLICY_LOSSES_NOT_BUILT` with the reason, which the config check prints.
"""
from __future__ import annotations

import functools
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


_P = "recipe.algos.policy_losses."
POLICY_LOSSES: dict[str, str] = {
    "vanilla": _P + "vanilla",
    "gspo": _P + "gspo",
    "gpg": _P + "gpg",
    "clip_cov": _P + "clip_cov",
    "kl_cov": _P + "kl_cov",
    "geo_mean": _P + "geo_mean",
}
"""Each loss mode's `fn(PGInputs, PolicyLossConfig) -> (pg_loss, clipped, clipped_lower)`, by dotted path."""

POLICY_LOSSES_NOT_BUILT: dict[str, str] = {
    "sapo": "its soft sigmoid gate (actor.tau_pos / tau_neg) has no config here yet",
    "cispo": "its clipped, detached IS weight on log pi is not written here yet",
    "dppo_tv": "its total-variation trust region is not written here yet",
    "dppo_kl": "its KL trust region is not written here yet",
    "dro": "its quadratic log-ratio penalty (policy_loss.dro_beta) has no config here yet",
    "bypass_mode": "it takes the engine's log-probs as the old policy; here algorithm.rollout_correction weighs "
                   "tokens instead (use loss_mode=vanilla with it)",
}
"""verl's loss modes polyturn refuses at launch, each with why."""


@functools.lru_cache(maxsize=None)
def load_policy_loss(mode: str) -> Callable[..., Any]:
    """The function of policy-loss mode `mode` (a key of POLICY_LOSSES)."""
    return import_object(POLICY_LOSSES[mode], f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}")
