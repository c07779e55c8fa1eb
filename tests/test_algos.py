"""Unit tests of recipe.algos against values worked out by hand (or in numpy, independently)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recipe.algos import (
    ADV_ESTIMATORS,
    AdaptiveKLController,
    AdvantageInputs,
    AlgorithmConfig,
    FixedKLController,
    KLControlConfig,
    LOSS_AGG_MODES,
    PolicyLossConfig,
    ValueLossConfig,
    apply_kl_penalty,
    compute_advantage,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    place_token_rewards,
    policy_loss,
    RolloutCorrectionConfig,
    value_loss,
)

pytestmark = pytest.mark.unit


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def np_whiten(values: list[float]) -> np.ndarray:
    """Reference whitening over a flat list of the masked values (unbiased std, as the estimators use)."""
    v = np.asarray(values, dtype=np.float64)
    return (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8)


# ---------------------------------------------------------------- masked reductions


def test_masked_stats_ignore_masked_positions_even_nan():
    """Contract: masked mean/var/whiten read only mask-1 positions; NaN padding never leaks in."""
    x = t([[1.0, 2.0, 3.0], [4.0, float("nan"), 6.0]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    # valid values 1, 2, 4, 6: mean 13/4; squared deviations 5.0625, 1.5625, 0.5625, 7.5625 -> sum 14.75
    assert masked_mean(x, mask).item() == pytest.approx(3.25)
    assert masked_var(x, mask).item() == pytest.approx(14.75 / 3)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(14.75 / 4)
    assert masked_mean(x, mask, dim=-1).tolist() == pytest.approx([1.5, 5.0])
    w = masked_whiten(x, mask)
    expected = (np.array([1, 2, 4, 6]) - 3.25) / math.sqrt(14.75 / 3 + 1e-8)
    assert w[mask.bool()].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    unshifted = masked_whiten(x, mask, shift_mean=False)
    assert unshifted[mask.bool()].tolist() == pytest.approx((expected + 3.25).tolist(), abs=1e-6)


def test_masked_mean_of_empty_row_is_zero_and_var_refuses_one_token():
    """Contract: an empty row has mean 0 (no NaN); variance of fewer than 2 tokens is refused clearly."""
    x = t([[1.0, 2.0], [3.0, 4.0]])
    assert masked_mean(x, t([[0, 0], [1, 1]]), dim=-1).tolist() == [0.0, 3.5]
    with pytest.raises(ValueError, match="at least 2 positions"):
        masked_var(x, t([[0, 0], [0, 1]]))


# ---------------------------------------------------------------- token rewards


def test_place_token_rewards_outcome_tool_interaction_weights():
    """Contract: outcome sits on the last sampled token, step rewards on the last sampled token of their
    turn (an index on a tool/user token snaps back to the assistant turn), each kind scaled by its weight."""
    # sample 0: assistant 0-1, tool response 2-3, assistant 4-5, padding 6; sample 1: assistant 0-2
    mask = t([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])
    rewards = place_token_rewards(
        mask,
        t([1.0, 0.5]),
        tool_rewards=[[(1, 0.3)], []],
        interaction_rewards=[[(3, 0.2)], [(2, -1.0)]],
        outcome_weight=2.0,
        tool_weight=0.5,
        interaction_weight=1.0,
    )
    expected = [
        [0.0, 0.5 * 0.3 + 0.2, 0.0, 0.0, 0.0, 2.0 * 1.0, 0.0],
        [0.0, 0.0, 2.0 * 0.5 - 1.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert rewards.tolist() == [pytest.approx(row) for row in expected]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"outcome": [1.0, float("nan")]}, "outcome reward of sample 1"),
        ({"outcome": [1.0, 2.0, 3.0]}, r"outcome has shape \(3,\) but response_mask has shape \(2, 4\)"),
        ({"tool_rewards": [[], [(4, 1.0)]]}, "tool reward of sample 1 sits at token 4"),
        ({"tool_rewards": [[(0, 1.0)], []]}, "tool reward of sample 0 at token 0 comes before any sampled token"),
        ({"interaction_rewards": [[(2, float("inf"))], []]}, "interaction reward of sample 0 at token 2 is inf"),
        ({"mask": [[0, 1, 1, 0], [0, 0, 0, 0]]}, "sample 1 has no sampled response token"),
    ],
)
def test_place_token_rewards_refuses_bad_input_naming_the_sample(kwargs, message):
    """Contract: bad rewards, indices and empty responses fail with an error naming the sample."""
    mask = t(kwargs.pop("mask", [[0, 1, 1, 0], [1, 1, 0, 0]]))
    outcome = t(kwargs.pop("outcome", [1.0, 0.0]))
    with pytest.raises(ValueError, match=message):
        place_token_rewards(mask, outcome, **kwargs)


# ---------------------------------------------------------------- advantage estimators


def outcome_rewards(mask: torch.Tensor, scores: list[float]) -> torch.Tensor:
    return place_token_rewards(mask, t(scores))


def test_grpo_group_normalised_and_singletons_zero():
    """Contract: GRPO advantage = (score - group mean) / (unbiased group std + eps) on every sampled token;
    a group with equal scores or a single sample gets 0; scores are the sum of all token rewards."""
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    rewards = outcome_rewards(mask, [1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    rewards[2, 0] = 0.5  # a step reward: sample 2 scores 0.5 in total
    index = ["a", "a", "a", "b", "b", "c"]
    adv, ret = compute_advantage(AdvantageInputs(rewards, mask, index=index), AlgorithmConfig(adv_estimator="grpo"))
    scores_a = np.array([1.0, 0.0, 0.5])
    expected_a = (scores_a - scores_a.mean()) / (scores_a.std(ddof=1) + 1e-6)
    expected = torch.zeros(6)
    expected[:3] = torch.tensor(expected_a, dtype=torch.float32)
    assert torch.allclose(adv, expected.unsqueeze(-1) * mask, atol=1e-6)
    assert torch.equal(adv, ret)

    cfg = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=False)
    uids = np.array(index, dtype=object)  # verl passes the uid column as a numpy object array
    adv, _ = compute_advantage(AdvantageInputs(rewards, mask, index=uids), cfg)
    expected[:3] = torch.tensor(scores_a - scores_a.mean(), dtype=torch.float32)
    assert torch.allclose(adv, expected.unsqueeze(-1) * mask, atol=1e-6)


def test_rloo_leave_one_out_baseline():
    """Contract: RLOO advantage = score - mean of the other samples' scores; singletons get 0."""
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1]])
    rewards = outcome_rewards(mask, [1.0, 0.0, 0.0, 7.0])
    adv, _ = compute_advantage(
        AdvantageInputs(rewards, mask, index=[0, 0, 0, 1]), AlgorithmConfig(adv_estimator="rloo")
    )
    # sample 0: 1 - (0 + 0)/2 = 1; samples 1, 2: 0 - (1 + 0)/2 = -0.5; sample 3 alone: 0
    assert adv.tolist() == [[1.0, 1.0], [-0.5, 0.0], [-0.5, -0.5], [0.0, 0.0]]


def test_gae_jumps_over_tool_tokens():
    """Contract: GAE bootstraps from the next *sampled* token, skipping mask-0 (tool/user) tokens whose
    values are ignored; returns = A + V before whitening; advantages whitened over the batch."""
    mask = t([[1, 0, 1, 1], [1, 1, 0, 0]])
    values = t([[0.5, 9.0, 0.2, 0.4], [0.1, 0.3, 7.0, 7.0]])
    rewards = t([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8)
    adv, ret = compute_advantage(AdvantageInputs(rewards, mask, values=values), cfg)
    # row 0, gamma*lam = 0.72: t3 delta = 1 - 0.4 = 0.6; t2 delta = 0.9*0.4 - 0.2 = 0.16, A = 0.16 + 0.72*0.6
    # = 0.592; t1 skipped; t0 delta = 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.72*0.592 = 0.10624
    # row 1: t1 delta = 2 - 0.3 = 1.7; t0 delta = 0.9*0.3 - 0.1 = 0.17, A = 0.17 + 0.72*1.7 = 1.394
    raw = {(0, 0): 0.10624, (0, 2): 0.592, (0, 3): 0.6, (1, 0): 1.394, (1, 1): 1.7}
    expected_ret = [[0.10624 + 0.5, 0.0, 0.592 + 0.2, 0.6 + 0.4], [1.394 + 0.1, 1.7 + 0.3, 0.0, 0.0]]
    assert ret.tolist() == [pytest.approx(row, abs=1e-6) for row in expected_ret]
    whitened = np_whiten(list(raw.values()))
    for (i, j), w in zip(raw, whitened):
        assert adv[i, j].item() == pytest.approx(w, abs=1e-5)
    assert adv[0, 1].item() == 0.0 and adv[1, 2:].tolist() == [0.0, 0.0]


def test_reinforce_plus_plus_discounted_return_skips_tool_tokens():
    """Contract: REINFORCE++ return-to-go is discounted over sampled tokens only, then whitened globally."""
    mask = t([[1, 0, 1, 1], [1, 1, 0, 0]])
    rewards = t([[0.2, 0.0, 0.0, 1.0], [0.0, 3.0, 0.0, 0.0]])
    adv, ret = compute_advantage(
        AdvantageInputs(rewards, mask), AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.5)
    )
    # row 0: t3 = 1; t2 = 0.5*1 = 0.5; t1 skipped; t0 = 0.2 + 0.5*0.5 = 0.45; row 1: t1 = 3; t0 = 1.5
    assert ret.tolist() == [pytest.approx([0.45, 0.0, 0.5, 1.0]), pytest.approx([1.5, 3.0, 0.0, 0.0])]
    w = np_whiten([0.45, 0.5, 1.0, 1.5, 3.0])
    assert adv[mask.bool()].tolist() == pytest.approx(w.tolist(), abs=1e-5)
    assert adv[~mask.bool()].abs().sum().item() == 0.0


def test_reinforce_plus_plus_baseline_and_remax():
    """Contract: REINFORCE++-baseline whitens (score - group mean) over tokens; ReMax subtracts the greedy
    baseline from the undiscounted return-to-go."""
    mask = t([[1, 1], [1, 0], [1, 1]])
    rewards = outcome_rewards(mask, [1.0, 0.0, 4.0])
    adv, _ = compute_advantage(
        AdvantageInputs(rewards, mask, index=["a", "a", "b"]),
        AlgorithmConfig(adv_estimator="reinforce_plus_plus_baseline"),
    )
    # centred scores: 0.5, -0.5, 0 (singleton) -> tokens 0.5, 0.5, -0.5, 0, 0
    assert adv[mask.bool()].tolist() == pytest.approx(np_whiten([0.5, 0.5, -0.5, 0.0, 0.0]).tolist(), abs=1e-5)

    mask = t([[1, 1, 1, 1]])
    rewards = t([[0.0, 1.0, 0.0, 2.0]])
    adv, ret = compute_advantage(
        AdvantageInputs(rewards, mask, reward_baselines=t([1.5])), AlgorithmConfig(adv_estimator="remax")
    )
    assert ret.tolist() == [[3.0, 3.0, 2.0, 2.0]]
    assert adv.tolist() == [[1.5, 1.5, 0.5, 0.5]]


def test_advantage_inputs_refused_with_named_sample():
    """Contract: NaN rewards, rewards on mask-0 tokens, missing estimator inputs and shape mismatches
    are refused, naming the sample / both shapes."""
    mask = t([[1, 1], [1, 0]])
    cfg = AlgorithmConfig(adv_estimator="grpo")
    with pytest.raises(ValueError, match="token reward of sample 1 is nan at token 0"):
        compute_advantage(AdvantageInputs(t([[0.0, 1.0], [float("nan"), 0.0]]), mask, index=[0, 0]), cfg)
    with pytest.raises(ValueError, match="sample 1 has reward 2.0 at token 1, where response_mask is 0"):
        compute_advantage(AdvantageInputs(t([[0.0, 1.0], [0.0, 2.0]]), mask, index=[0, 0]), cfg)
    with pytest.raises(ValueError, match=r"token_rewards has shape \(2, 3\) but response_mask has shape \(2, 2\)"):
        compute_advantage(AdvantageInputs(torch.zeros(2, 3), mask, index=[0, 0]), cfg)
    with pytest.raises(ValueError, match="needs index"):
        compute_advantage(AdvantageInputs(torch.zeros(2, 2), mask), cfg)
    with pytest.raises(ValueError, match="gae needs values"):
        compute_advantage(AdvantageInputs(torch.zeros(2, 2), mask), AlgorithmConfig(adv_estimator="gae"))
    with pytest.raises(ValueError, match="value of sample 0 is inf"):
        compute_advantage(
            AdvantageInputs(torch.zeros(2, 2), mask, values=t([[0.0, float("inf")], [0.0, 0.0]])),
            AlgorithmConfig(adv_estimator="gae"),
        )


# ---------------------------------------------------------------- KL


def test_kl_penalty_kinds_by_hand():
    """Contract: each KL kind is the textbook per-token estimator; k3 is clamped like verl; full is refused."""
    lp, ref = t([-1.0, -2.0, 0.0]), t([-1.5, -1.0, -30.0])
    for kind in ("kl", "k1"):
        assert kl_penalty(lp, ref, kind).tolist() == pytest.approx([0.5, -1.0, 30.0])
    assert kl_penalty(lp, ref, "abs").tolist() == pytest.approx([0.5, 1.0, 30.0])
    for kind in ("mse", "k2"):
        assert kl_penalty(lp, ref, kind).tolist() == pytest.approx([0.125, 0.5, 450.0])
    # k3 = exp(ref - lp) - (ref - lp) - 1: exp(-0.5) + 0.5 - 1, exp(1) - 2, and the clamp at 10
    expected_k3 = [math.exp(-0.5) - 0.5, math.e - 2.0, 10.0]
    for kind in ("low_var_kl", "k3"):
        assert kl_penalty(lp, ref, kind).tolist() == pytest.approx(expected_k3, abs=1e-6)
    with pytest.raises(ValueError, match="'full' needs the whole vocabulary"):
        kl_penalty(lp, ref, "full")
    with pytest.raises(ValueError, match="unknown KL kind 'k9'"):
        kl_penalty(lp, ref, "k9")


def test_kl_controllers():
    """Contract: the adaptive controller moves beta by clip(KL/target - 1, +-0.2) * n/horizon; fixed stays."""
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=100)  # error 0.5 -> clipped 0.2 -> x1.002
    assert ctrl.value == pytest.approx(0.1 * 1.002)
    ctrl.update(current_kl=6.6, n_steps=100)  # error 0.1 -> x1.001
    assert ctrl.value == pytest.approx(0.1 * 1.002 * 1.001)
    ctrl.update(current_kl=0.0, n_steps=1000)  # error -1 -> clipped -0.2 -> x0.98
    assert ctrl.value == pytest.approx(0.1 * 1.002 * 1.001 * 0.98)
    fixed = make_kl_controller(KLControlConfig(type="fixed", kl_coef=0.05))
    fixed.update(current_kl=100.0, n_steps=100)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    assert isinstance(make_kl_controller(KLControlConfig(type="adaptive")), AdaptiveKLController)


def test_apply_kl_penalty_in_reward():
    """Contract: rewards lose beta * KL on sampled tokens only; the controller sees the mean per-sample KL."""
    rewards = t([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    old = t([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = t([[-1.5, -1.0, -9.0], [-2.0, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    new, metrics = apply_kl_penalty(rewards, old, ref, mask, ctrl, kind="kl")
    # kl row 0: 0.5, -1 (t2 masked); row 1: 1.0
    assert new.tolist() == [pytest.approx([-0.05, 1.1, 0.0]), pytest.approx([1.9, 0.0, 0.0])]
    current = ((0.5 - 1.0) / 2 + 1.0) / 2  # 0.375
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(current), "actor/reward_kl_penalty_coeff": 0.1}
    assert ctrl.value == pytest.approx(0.1 * (1 + (-0.2) * 2 / 100))


# ---------------------------------------------------------------- policy loss


def mini_batch(b: int = 8, t_len: int = 6, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t_len + 1, (b,), generator=g)
    mask = (torch.arange(t_len) < lengths.unsqueeze(-1)).float()
    mask[0, 0] = 0.0 if lengths[0] > 1 else 1.0  # a hole inside a response (tool token)
    old = -torch.rand(b, t_len, generator=g) * 3
    return {
        "log_probs": old + torch.randn(b, t_len, generator=g) * 0.4,
        "old_log_probs": old,
        "ref_log_probs": old + torch.randn(b, t_len, generator=g) * 0.2,
        "advantages": torch.randn(b, t_len, generator=g) * 2,
        "entropy": torch.rand(b, t_len, generator=g) * 2,
        "response_mask": mask,
        "values": torch.randn(b, t_len, generator=g),
        "old_values": torch.randn(b, t_len, generator=g),
        "returns": torch.randn(b, t_len, generator=g),
    }


def split(batch: dict, bounds: list[int], grad_key: str) -> tuple[list[dict], torch.Tensor]:
    """Micro-batches over row ranges, each trimmed to its own padded width, with global counts."""
    leaf = batch[grad_key].clone().requires_grad_(True)
    full = {**batch, grad_key: leaf}
    n_tok, n_seq = int(batch["response_mask"].sum()), batch["response_mask"].shape[0]
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        width = int(batch["response_mask"][lo:hi].sum(0).nonzero().max()) + 1
        mb = {k: v[lo:hi, :width] for k, v in full.items()}
        parts.append({**mb, "global_token_count": n_tok, "global_seq_count": n_seq})
    return parts, leaf


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_micro_batch_shares_sum_to_full_batch(mode):
    """Contract: summed over micro-batches (any split, any padded width) the loss, its gradient and every
    metric equal the full-batch values within 1e-6, for every loss_agg_mode, with KL loss and entropy on."""
    cfg = PolicyLossConfig(
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode, loss_scale_factor=6,
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coeff=0.01,
    )
    batch = mini_batch()
    results = []
    for bounds in ([0, 8], [0, 4, 8], [0, 2, 4, 6, 8], [0, 3, 8]):
        parts, leaf = split(batch, bounds, "log_probs")
        total, metrics = 0.0, {}
        for mb in parts:
            loss, m = policy_loss(mb, cfg)
            total = total + loss
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v
        total.backward()
        results.append((total.item(), leaf.grad.clone(), metrics))
    ref_loss, ref_grad, ref_metrics = results[0]
    assert set(ref_metrics) == {"pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss"}
    assert 0 < ref_metrics["pg_clipfrac"] < 1  # the random batch exercises clipping
    for loss, grad, metrics in results[1:]:
        assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)  # token-sum: an unnormalised fp32 sum
        assert torch.allclose(grad, ref_grad, atol=1e-6)
        for k in ref_metrics:
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-6, abs=1e-6)


def test_policy_loss_and_gradient_by_hand():
    """Contract: the PPO loss covers unclipped, clip-higher, in-range negative and dual-clipped tokens, and
    d loss / d log_probs equals the analytic gradient -A * ratio / N on unclipped tokens, 0 on clipped ones,
    plus the KL-loss term coef * (1 - exp(ref - lp)) / N (k3) and nothing from masked tokens."""
    ratios = [1.5, 0.7, 1.1, 4.0, 2.0]
    log_probs = torch.log(t(ratios)).unsqueeze(0).requires_grad_(True)  # old log-probs are 0
    ref = t([[-0.5, 0.2, 0.0, 1.0, 0.0]])
    mb = {
        "log_probs": log_probs,
        "old_log_probs": torch.zeros(1, 5),
        "ref_log_probs": ref,
        "advantages": t([[1.0, 1.0, -1.0, -1.0, 5.0]]),
        "response_mask": t([[1, 1, 1, 1, 0]]),
        "global_token_count": 4,
        "global_seq_count": 1,
    }
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, use_kl_loss=True,
                           kl_loss_coef=0.5, kl_loss_type="k3")
    loss, metrics = policy_loss(mb, cfg)
    # per token: max(-1.5, -1.28) = -1.28 (clipped high); max(-0.7, -0.8) = -0.7; 1.1 (in range);
    # A<0 and 4.0 > 3.0 -> dual-clipped to 3.0; the masked token (ratio 2, A 5) is ignored
    pg = (-1.28 - 0.7 + 1.1 + 3.0) / 4
    lp = np.log(ratios[:4])
    k3 = np.exp(ref[0, :4].numpy() - lp) - (ref[0, :4].numpy() - lp) - 1
    assert metrics["pg_loss"] == pytest.approx(pg, abs=1e-6)
    assert metrics["kl_loss"] == pytest.approx(k3.mean(), abs=1e-6)
    assert loss.item() == pytest.approx(pg + 0.5 * k3.mean(), abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)  # token 0
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25)  # token 3
    assert metrics["ppo_kl"] == pytest.approx(-lp.sum() / 4, abs=1e-6)
    loss.backward()
    pg_grad = np.array([0.0, -1.0 * 0.7, 1.0 * 1.1, 0.0]) / 4
    kl_grad = 0.5 * (1 - np.exp(ref[0, :4].numpy() - lp)) / 4
    expected = np.append(pg_grad + kl_grad, 0.0)
    assert log_probs.grad[0].tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def test_loss_agg_modes_by_hand():
    """Contract: the loss_agg_modes (verl v0.9's five, token-sum included) follow verl's definitions with global
    denominators."""
    adv = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mb = {
        "log_probs": torch.zeros(2, 3), "old_log_probs": torch.zeros(2, 3), "advantages": adv,
        "response_mask": t([[1, 1, 0], [1, 1, 1]]), "global_token_count": 5, "global_seq_count": 2,
    }
    # ratio 1 -> per-token loss -A; row sums -3 (2 tokens) and -15 (3 tokens)
    expected = {
        "token-mean": -18 / 5,
        "token-sum": -18.0,
        "seq-mean-token-sum": -18 / 2,
        "seq-mean-token-mean": (-3 / 2 - 15 / 3) / 2,
        "seq-mean-token-sum-norm": -18 / (2 * 10),
    }
    for mode, value in expected.items():
        loss, _ = policy_loss(mb, PolicyLossConfig(loss_agg_mode=mode, loss_scale_factor=10))
        assert loss.item() == pytest.approx(value), mode


def test_entropy_bonus_lowers_the_loss():
    """Contract: entropy_coeff subtracts coeff * aggregated entropy; the entropy metric is reported."""
    mb = {
        "log_probs": torch.zeros(1, 2), "old_log_probs": torch.zeros(1, 2), "advantages": t([[1.0, 1.0]]),
        "entropy": t([[2.0, 4.0]]), "response_mask": t([[1, 1]]), "global_token_count": 2, "global_seq_count": 1,
    }
    loss, metrics = policy_loss(mb, PolicyLossConfig(entropy_coeff=0.1))
    assert loss.item() == pytest.approx(-1.0 - 0.1 * 3.0)
    assert metrics["entropy"] == pytest.approx(3.0)


def test_policy_loss_refuses_bad_micro_batches():
    """Contract: shape mismatches name both shapes, NaN advantages name the row (NaN under mask 0 is fine),
    missing inputs name the key and the fix."""
    base = {
        "log_probs": torch.zeros(2, 3), "old_log_probs": torch.zeros(2, 3), "advantages": torch.zeros(2, 3),
        "response_mask": t([[1, 1, 0], [1, 1, 1]]), "global_token_count": 5, "global_seq_count": 2,
    }
    cfg = PolicyLossConfig()
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\) but response_mask has shape \(2, 3\)"):
        policy_loss({**base, "advantages": torch.zeros(2, 4)}, cfg)
    bad = torch.zeros(2, 3)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="advantage of micro-batch row 1 is nan at token 2"):
        policy_loss({**base, "advantages": bad}, cfg)
    padded = torch.zeros(2, 3)
    padded[0, 2] = float("nan")  # under mask 0: padding may hold anything
    loss, _ = policy_loss({**base, "advantages": padded}, cfg)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="lacks 'global_token_count'"):
        policy_loss({k: v for k, v in base.items() if k != "global_token_count"}, cfg)
    with pytest.raises(ValueError, match="use_kl_loss is true but the micro-batch lacks 'ref_log_probs'"):
        policy_loss(base, PolicyLossConfig(use_kl_loss=True))
    with pytest.raises(ValueError, match="lacks 'entropy'"):
        policy_loss(base, PolicyLossConfig(entropy_coeff=0.01))


# ---------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    """Contract: 0.5 * max((v - R)^2, (v_clipped - R)^2), gradient 0 where the clipped branch wins."""
    values = t([[1.0, 0.6]]).requires_grad_(True)
    mb = {
        "values": values, "old_values": torch.zeros(1, 2), "returns": t([[0.5, 1.0]]),
        "response_mask": t([[1, 1]]), "global_token_count": 2, "global_seq_count": 1,
    }
    loss, metrics = value_loss(mb, ValueLossConfig(cliprange_value=0.2))
    # token 0: max((1-0.5)^2, (0.2-0.5)^2) = 0.25; token 1: max((0.6-1)^2, (0.2-1)^2) = 0.64 (clipped)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.64) / 2)
    assert metrics == {"vf_loss": pytest.approx(0.2225), "vf_clipfrac": 0.5, "vpred_mean": pytest.approx(0.8)}
    loss.backward()
    assert values.grad.tolist() == [pytest.approx([0.5 * 2 * 0.5 / 2, 0.0])]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_micro_batch_shares_sum_to_full_batch(mode):
    """Contract: value-loss shares and gradients summed over micro-batches equal the full batch."""
    cfg = ValueLossConfig(cliprange_value=0.3, loss_agg_mode=mode, loss_scale_factor=6)
    batch = mini_batch(seed=1)
    results = []
    for bounds in ([0, 8], [0, 4, 8], [0, 2, 4, 6, 8]):
        parts, leaf = split(batch, bounds, "values")
        total = sum(value_loss(mb, cfg)[0] for mb in parts)
        total.backward()
        results.append((total.item(), leaf.grad.clone()))
    for loss, grad in results[1:]:
        assert loss == pytest.approx(results[0][0], abs=1e-6)
        assert torch.allclose(grad, results[0][1], atol=1e-6)


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: PolicyLossConfig(clip_ratio_high=-0.1), "actor_rollout_ref.actor.clip_ratio_high"),
        (lambda: PolicyLossConfig(clip_ratio_low=1.0), "actor_rollout_ref.actor.clip_ratio_low"),
        (lambda: PolicyLossConfig(clip_ratio_c=0.9), "actor_rollout_ref.actor.clip_ratio_c"),
        (lambda: PolicyLossConfig(loss_agg_mode="sum"), "actor_rollout_ref.actor.loss_agg_mode"),
        (lambda: PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=0),
         "actor_rollout_ref.actor.loss_scale_factor"),
        (lambda: PolicyLossConfig(kl_loss_type="full"), "actor_rollout_ref.actor.kl_loss_type"),
        (lambda: ValueLossConfig(cliprange_value=0.0), "critic.cliprange_value"),
        (lambda: AlgorithmConfig(adv_estimator="ppo"), "algorithm.adv_estimator"),
        (lambda: AlgorithmConfig(gamma=1.5), "algorithm.gamma"),
        (lambda: AlgorithmConfig(kl_penalty="k9"), "algorithm.kl_penalty"),
        (lambda: AlgorithmConfig(kl_ctrl={"type": "pid"}), "algorithm.kl_ctrl.type"),
        (lambda: KLControlConfig(type="adaptive", target_kl=0.0), "algorithm.kl_ctrl.target_kl"),
        (lambda: AlgorithmConfig(rollout_correction={"rollout_is": "seq"}), "algorithm.rollout_correction.rollout_is"),
        (lambda: RolloutCorrectionConfig(rollout_rs="token"), "algorithm.rollout_correction.rollout_rs"),
        (lambda: RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0),
         "algorithm.rollout_correction.rollout_rs_threshold_lower"),
    ],
)
def test_config_errors_name_the_key(make, key):
    """Contract: an invalid config value fails at construction with the full Hydra key in the message."""
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make()


def test_registry_has_verl_names():
    """Contract: algorithm.adv_estimator accepts verl's estimator names."""
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"} <= set(ADV_ESTIMATORS)
