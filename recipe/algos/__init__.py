"""RL algorithms as pure tensor functions: token rewards, advantages, KL, PPO losses.

Submodules: `rewards` (where rewards sit on the token axis), `advantages` (the estimators),
`registry` (each estimator's name, function and needs; the policy-loss modes), `kl` (KL estimators and KL-in-reward controllers),
`losses` (policy and value losses whose micro-batch shares sum to the mini-batch loss), `policy_losses` (verl's
policy-loss modes: vanilla, gspo, gpg, clip_cov, kl_cov, geo_mean), `masked` (masked reductions),
`checks` (input validation). Everything a trainer needs is re-exported here.
"""
from recipe.algos.advantages import (
    FILTER_METRICS,
    AdvantageInputs,
    AlgorithmConfig,
    FilterGroupsConfig,
    compute_advantage,
)
from recipe.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KLControlConfig,
    KLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from recipe.algos.losses import (LOSS_AGG_MODES, PolicyLossConfig, PolicyLossModeConfig, ValueLossConfig, agg_loss,
                                 policy_loss, value_loss)
from recipe.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from recipe.algos.registry import ADV_ESTIMATORS, POLICY_LOSSES, EstimatorSpec
from recipe.algos.rewards import last_sampled_index, place_token_rewards
from recipe.algos.rollout_correction import RolloutCorrectionConfig, rollout_weights

__all__ = [
    "ADV_ESTIMATORS",
    "FILTER_METRICS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AlgorithmConfig",
    "EstimatorSpec",
    "FilterGroupsConfig",
    "FixedKLController",
    "KLControlConfig",
    "KLController",
    "PolicyLossConfig",
    "PolicyLossModeConfig",
    "RolloutCorrectionConfig",
    "ValueLossConfig",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "kl_penalty",
    "last_sampled_index",
    "make_kl_controller",
    "rollout_weights",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "place_token_rewards",
    "policy_loss",
    "value_loss",
]
