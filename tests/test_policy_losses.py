"""Unit tests of the policy-loss modes (recipe/algos/policy_losses.py) and the straight-through KL kinds, each
against a reference written here independently (loops over sequences and tokens, numpy), values and gradients."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recipe.algos import KL_KINDS, PolicyLossConfig, PolicyLossModeConfig, kl_penalty, policy_loss
from recipe.algos.registry import POLICY_LOSSES, POLICY_LOSSES_NOT_BUILT, load_policy_loss

pytestmark = pytest.mark.unit

MASK = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]


def batch(seed: int = 0, seq_adv: bool = True, mask: list[list[int]] = MASK) -> dict:
    """A (4, 5) micro-batch that is the whole mini-batch; advantages constant per sequence when seq_adv."""
    g = torch.Generator().manual_seed(seed)
    m = torch.tensor(mask, dtype=torch.float32)
    b, t = m.shape
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone() if seq_adv else torch.randn(b, t, generator=g)
    return {
        "log_probs": (torch.randn(b, t, generator=g) * 0.3 - 1.0).requires_grad_(True),
        "old_log_probs": torch.randn(b, t, generator=g) * 0.3 - 1.0,
        "advantages": adv,
        "response_mask": m,
        "global_token_count": int(m.sum()),
        "global_seq_count": b,
    }


def cfg(mode: str, **kw) -> PolicyLossConfig:
    mode_kw = {k: kw.pop(k) for k in list(kw) if k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
                                                       "kl_cov_ratio", "ppo_kl_coef")}
    return PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, policy_loss={"loss_mode": mode, **mode_kw}, **kw)


def tokens(mb: dict, i: int) -> range:
    return range(int(mb["response_mask"][i].sum()))


def loss_and_grad(mb: dict, c: PolicyLossConfig) -> tuple[float, torch.Tensor, dict]:
    lp = mb["log_probs"].detach().clone().requires_grad_(True)
    loss, metrics = policy_loss({**mb, "log_probs": lp}, c)
    loss.backward()
    return loss.item(), lp.grad, metrics


def ref_grad(mb: dict, ref_fn) -> tuple[float, torch.Tensor]:
    lp = mb["log_probs"].detach().clone().requires_grad_(True)
    loss = ref_fn({**mb, "log_probs": lp})
    loss.backward()
    return loss.item(), lp.grad


def test_registry_names_verl_modes_and_every_entry_loads():
    """Contract: the loss modes are verl's names; each entry loads a function; the refused ones are not built."""
    assert {"vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean"} <= set(POLICY_LOSSES)
    assert not set(POLICY_LOSSES) & set(POLICY_LOSSES_NOT_BUILT)
    assert all(callable(load_policy_loss(mode)) for mode in POLICY_LOSSES)
    assert PolicyLossConfig().policy_loss.loss_mode == "vanilla"


def test_vanilla_matches_a_token_loop_with_gradients():
    """Contract: the default mode is PPO with clip-higher and dual-clip, token-mean: value and gradient."""
    mb = batch(1, seq_adv=False)

    def ref(m: dict) -> torch.Tensor:
        total = 0.0
        for i in range(4):
            for t in tokens(m, i):
                r, a = torch.exp(m["log_probs"][i, t] - m["old_log_probs"][i, t]), m["advantages"][i, t]
                loss = torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))
                total = total + (torch.minimum(loss, -a * 3.0) if a < 0 else loss)
        return total / m["global_token_count"]

    with torch.no_grad():
        mb["old_log_probs"][1] -= 1.5  # ratios near e^1.5 > clip_ratio_c: dual-clip where A < 0
        mb["advantages"][1] = torch.tensor([-1.0, 0.5, -0.3, 1.0, -2.0])
    value, grad, metrics = loss_and_grad(mb, cfg("vanilla"))
    assert metrics["pg_clipfrac_lower"] > 0 and metrics["pg_clipfrac"] > 0
    want, want_grad = ref_grad(mb, ref)
    assert value == pytest.approx(want, abs=1e-6)
    assert torch.allclose(grad, want_grad, atol=1e-6)


def gspo_reference(m: dict) -> torch.Tensor:
    """The GSPO paper's objective (sequence advantages): mean over sequences of max(-A s_i, -A clip(s_i)), with
    s_i = exp(mean_t log r) differentiated as it stands (no stop-gradient tricks)."""
    total = 0.0
    for i in range(m["response_mask"].shape[0]):
        n = len(tokens(m, i))
        s = torch.exp((m["log_probs"][i, :n] - m["old_log_probs"][i, :n]).mean())
        a = m["advantages"][i, 0]
        total = total + torch.maximum(-a * s, -a * s.clamp(0.8, 1.28))
    return total / m["global_seq_count"]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_gspo_matches_the_papers_sequence_objective_with_gradients(agg):
    """Contract: gspo is the paper's sequence-level clipped objective, value and gradient, whatever loss_agg_mode
    says (it always aggregates seq-mean-token-mean); its pg_clipfrac counts the tokens of clipped sequences."""
    for seed in range(4):
        mb = batch(seed)
        value, grad, metrics = loss_and_grad(mb, cfg("gspo", loss_agg_mode=agg))
        want, want_grad = ref_grad(mb, gspo_reference)
        assert value == pytest.approx(want, abs=1e-6)
        assert torch.allclose(grad, want_grad, atol=1e-6)
        assert metrics["pg_clipfrac_lower"] == 0.0
    mb = batch(0)
    mb["old_log_probs"] = mb["log_probs"].detach() - 1.0  # every ratio e: every sequence above 1.28
    mb["advantages"] = torch.ones(4, 5)
    assert loss_and_grad(mb, cfg("gspo"))[2]["pg_clipfrac"] == pytest.approx(1.0)


def test_gspo_equals_vanilla_when_every_sequence_has_one_token():
    """Contract: with one sampled token per sequence (padding after it) the sequence ratio is the token ratio, so gspo
    and vanilla (without dual-clip) agree in value, gradient and metrics; with longer sequences they differ."""
    one = [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]]
    for seed in range(3):
        mb = batch(seed, seq_adv=False, mask=one)
        g_val, g_grad, g_met = loss_and_grad(mb, cfg("gspo", clip_ratio_c=None))
        v_val, v_grad, v_met = loss_and_grad(mb, cfg("vanilla", clip_ratio_c=None))
        assert g_val == pytest.approx(v_val, abs=1e-6) and torch.allclose(g_grad, v_grad, atol=1e-6)
        assert g_met == pytest.approx(v_met, abs=1e-6)
    mb = batch(0)
    assert loss_and_grad(mb, cfg("gspo"))[0] != pytest.approx(loss_and_grad(mb, cfg("vanilla"))[0], abs=1e-4)


def test_gpg_is_the_plain_policy_gradient():
    """Contract: gpg is -A log pi aggregated by loss_agg_mode: gradient -A / N on sampled tokens, nothing clipped."""
    mb = batch(2, seq_adv=False)
    value, grad, metrics = loss_and_grad(mb, cfg("gpg"))
    m, adv, lp = mb["response_mask"], mb["advantages"], mb["log_probs"].detach()
    n = mb["global_token_count"]
    assert value == pytest.approx(float((-adv * lp * m).sum() / n), abs=1e-6)
    assert torch.allclose(grad, -adv * m / n, atol=1e-6)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["pg_clipfrac_lower"] == 0.0


def np_cov(mb: dict) -> np.ndarray:
    """(A - mean A)(log pi - mean log pi) with the means over sampled tokens, NaN elsewhere."""
    m = mb["response_mask"].numpy().astype(bool)
    adv, lp = mb["advantages"].numpy(), mb["log_probs"].detach().numpy()
    return np.where(m, (adv - adv[m].mean()) * (lp - lp[m].mean()), np.nan)


def np_ppo(mb: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-token PPO loss (clip range [0.8, 1.28], no dual-clip) and where the clip won."""
    r = np.exp(mb["log_probs"].detach().numpy() - mb["old_log_probs"].numpy())
    adv = mb["advantages"].numpy()
    unclipped, clipped = -adv * r, -adv * np.clip(r, 0.8, 1.28)
    return np.maximum(unclipped, clipped), clipped > unclipped


def test_clip_cov_cuts_the_gradient_of_covariance_band_tokens():
    """Contract: clip_cov is PPO clipping (no dual-clip) where the tokens whose covariance lies in (lb, ub) and that
    the ratio clip left alone lose their loss and gradient, at most clip_cov_ratio of the tokens (chosen at random);
    pg_clipfrac counts ratio-clipped and cut tokens."""
    mb = batch(3, seq_adv=False)
    m = mb["response_mask"].numpy().astype(bool)
    n = int(m.sum())
    cov = np_cov(mb)
    losses, ratio_clipped = np_ppo(mb)
    band = m & ~ratio_clipped & (cov > -0.05) & (cov < 0.3)
    assert 1 < band.sum() < n - ratio_clipped[m].sum()  # the batch exercises the band
    value, grad, metrics = loss_and_grad(mb, cfg("clip_cov", clip_cov_ratio=1.0, clip_cov_lb=-0.05, clip_cov_ub=0.3))
    assert value == pytest.approx(float(np.where(m & ~band, losses, 0.0).sum() / n), abs=1e-6)
    assert (grad.numpy()[band] == 0).all() and (grad.numpy()[m & ~band & ~ratio_clipped] != 0).all()
    assert metrics["pg_clipfrac"] == pytest.approx((band | (ratio_clipped & m)).sum() / n)
    ratio = 1.0 / n  # one token cut
    _, grad, metrics = loss_and_grad(mb, cfg("clip_cov", clip_cov_ratio=ratio, clip_cov_lb=-0.05, clip_cov_ub=0.3))
    assert int((grad.numpy()[band] == 0).sum()) == 1
    assert metrics["pg_clipfrac"] == pytest.approx(((ratio_clipped & m).sum() + 1) / n)


def test_kl_cov_penalises_the_largest_covariance_tokens():
    """Contract: kl_cov is the unclipped surrogate -A r, plus ppo_kl_coef |log r| on the int(kl_cov_ratio * n)
    tokens of largest covariance (at least one); pg_clipfrac is their fraction."""
    mb = batch(4, seq_adv=False)
    m = mb["response_mask"].numpy().astype(bool)
    n = int(m.sum())
    log_r = mb["log_probs"].detach().numpy() - mb["old_log_probs"].numpy()
    base = -mb["advantages"].numpy() * np.exp(log_r)
    for ratio, k in ((0.0001, 1), (0.3, int(0.3 * n))):
        top = np.argsort(-np.nan_to_num(np_cov(mb), nan=-np.inf), axis=None)[:k]
        penalised = np.zeros(m.size, dtype=bool)
        penalised[top] = True
        penalised = penalised.reshape(m.shape)
        want = np.where(m, base + np.where(penalised, 0.5 * np.abs(log_r), 0.0), 0.0).sum() / n
        value, _, metrics = loss_and_grad(mb, cfg("kl_cov", kl_cov_ratio=ratio, ppo_kl_coef=0.5))
        assert value == pytest.approx(float(want), abs=1e-6)
        assert metrics["pg_clipfrac"] == pytest.approx(k / n)


def test_geo_mean_matches_a_sequence_loop_with_gradients():
    """Contract: geo_mean (GMPO) is, per sequence, -mean(A) * exp(mean over tokens of the log-ratio clipped to
    [-clip_ratio_low, clip_ratio_high] on sign(A)'s pessimistic side), averaged over sequences; pg_clipfrac counts
    the tokens whose gradient the clip took."""
    for seed in range(3):
        mb = batch(seed)
        mb["old_log_probs"] = mb["old_log_probs"] + torch.tensor([0.4, -0.4, 0.0, 0.3]).unsqueeze(-1)
        cut = 0

        def ref(m: dict) -> torch.Tensor:
            nonlocal cut
            total = 0.0
            for i in range(4):
                a, logs = m["advantages"][i, 0], []
                for t in tokens(m, i):
                    lr = m["log_probs"][i, t] - m["old_log_probs"][i, t]
                    clipped = lr.clamp(-0.2, 0.28)
                    pessimistic = torch.minimum(lr, clipped) if a > 0 else torch.maximum(lr, clipped)
                    cut += int(bool(pessimistic != lr))
                    logs.append(pessimistic)
                total = total - a * torch.exp(torch.stack(logs).mean())
            return total / 4

        value, grad, metrics = loss_and_grad(mb, cfg("geo_mean"))
        want, want_grad = ref_grad(mb, ref)
        assert value == pytest.approx(want, abs=1e-6) and torch.allclose(grad, want_grad, atol=1e-6)
        assert metrics["pg_clipfrac"] == pytest.approx(cut / mb["global_token_count"])


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg", "geo_mean"])
def test_exact_modes_sum_over_micro_batches_to_the_full_batch(mode):
    """Contract: for the modes without micro-batch statistics, summing the micro-batch shares (split by rows, each
    trimmed to its own width) gives the full batch's loss and gradient."""
    mb = batch(5, seq_adv=False)
    full, full_grad, _ = loss_and_grad(mb, cfg(mode))
    lp = mb["log_probs"].detach().clone().requires_grad_(True)
    total = 0.0
    for lo, hi in ((0, 1), (1, 3), (3, 4)):
        width = int(mb["response_mask"][lo:hi].sum(0).nonzero().max()) + 1
        part = {k: (v[lo:hi, :width] if torch.is_tensor(v) else v) for k, v in {**mb, "log_probs": lp}.items()}
        total = total + policy_loss(part, cfg(mode))[0]
    total.backward()
    assert total.item() == pytest.approx(full, abs=1e-6) and torch.allclose(lp.grad, full_grad, atol=1e-6)


def test_rollout_weights_of_one_change_nothing_in_any_mode():
    """Contract: every mode takes the rollout-correction weights; weights of 1 leave loss and gradient as they are,
    weights of 2 double them."""
    for mode in POLICY_LOSSES:
        mb = batch(6, seq_adv=False)
        c = cfg(mode, clip_cov_ratio=0.5, clip_cov_lb=-1.0, clip_cov_ub=1.0)
        torch.manual_seed(0)
        plain = loss_and_grad(mb, c)
        torch.manual_seed(0)
        ones = loss_and_grad({**mb, "rollout_is_weights": torch.ones(4, 5)}, c)
        torch.manual_seed(0)
        twos = loss_and_grad({**mb, "rollout_is_weights": torch.full((4, 5), 2.0)}, c)
        assert ones[0] == pytest.approx(plain[0], abs=1e-6), mode
        assert twos[0] == pytest.approx(2 * plain[0], abs=1e-5), mode
        assert torch.allclose(twos[1], 2 * plain[1], atol=1e-5), mode


def test_straight_through_kl_has_the_base_value_and_k2_gradient():
    """Contract: every `+` KL kind (k3+, low_var_kl+, k1+, abs+, ...) has its base kind's value and the gradient of
    k2, (log pi - log pi_ref), in both inputs; without the `+`, k3's gradient differs."""
    lp = torch.tensor([-1.0, -0.2, -2.5, -0.7])
    ref = torch.tensor([-0.4, -0.9, -1.0, -0.7])
    plus = [k for k in KL_KINDS if k.endswith("+")]
    assert {"k3+", "low_var_kl+", "k1+", "kl+", "abs+", "k2+", "mse+"} == set(plus)
    for kind in plus:
        a, b = lp.clone().requires_grad_(True), ref.clone().requires_grad_(True)
        value = kl_penalty(a, b, kind)
        value.sum().backward()
        assert torch.allclose(value, kl_penalty(lp, ref, kind[:-1]), atol=1e-7), kind
        assert torch.allclose(a.grad, lp - ref, atol=1e-7) and torch.allclose(b.grad, ref - lp, atol=1e-7), kind
    a = lp.clone().requires_grad_(True)
    kl_penalty(a, ref, "k3").sum().backward()
    assert torch.allclose(a.grad, 1 - torch.exp(ref - lp)) and not torch.allclose(a.grad, lp - ref)
    k3 = np.exp((ref - lp).numpy()) - (ref - lp).numpy() - 1
    assert kl_penalty(lp, ref, "k3+").tolist() == pytest.approx(k3.tolist(), abs=1e-6)
    assert math.isclose(kl_penalty(lp, ref, "k3+")[3].item(), 0.0, abs_tol=1e-7)


def test_policy_loss_uses_k3_plus_in_the_kl_loss():
    """Contract: kl_loss_type=k3+ reports k3's value as kl_loss and adds coef * (lp - ref) / N to the gradient."""
    mb = {**batch(7), "ref_log_probs": torch.randn(4, 5) * 0.3 - 1.0}
    base = loss_and_grad(mb, cfg("vanilla"))
    k3 = loss_and_grad(mb, cfg("vanilla", use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3"))
    plus = loss_and_grad(mb, cfg("vanilla", use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3+"))
    assert plus[2]["kl_loss"] == pytest.approx(k3[2]["kl_loss"], abs=1e-7) and plus[0] == pytest.approx(k3[0])
    m, n = mb["response_mask"], mb["global_token_count"]
    want = base[1] + 0.5 * (mb["log_probs"].detach() - mb["ref_log_probs"]) * m / n
    assert torch.allclose(plus[1], want, atol=1e-6)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"loss_mode": "sapo"}, r"^actor_rollout_ref\.actor\.policy_loss\.loss_mode=sapo is not built in polyturn: "),
        ({"loss_mode": "ppo"}, r"actor_rollout_ref\.actor\.policy_loss\.loss_mode is 'ppo'; use one of"),
        ({"clip_cov_ratio": 0.0}, r"actor_rollout_ref\.actor\.policy_loss\.clip_cov_ratio"),
        ({"kl_cov_ratio": 2.0}, r"actor_rollout_ref\.actor\.policy_loss\.kl_cov_ratio"),
        ({"clip_cov_lb": 5.0}, r"actor_rollout_ref\.actor\.policy_loss\.clip_cov_lb"),
        ({"ppo_kl_coef": -1.0}, r"actor_rollout_ref\.actor\.policy_loss\.ppo_kl_coef"),
    ],
)
def test_loss_mode_config_errors_name_the_key(kw, match):
    """Contract: a bad loss mode or mode setting fails at construction in one line naming the full key; verl's modes
    not built here say so and why."""
    with pytest.raises(ValueError, match=match) as err:
        PolicyLossModeConfig(**kw)
    assert "\n" not in str(err.value)
