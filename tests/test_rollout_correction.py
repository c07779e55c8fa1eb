"""Rollout correction (`algorithm.rollout_correction.*`): the weights by hand, the policy loss applying them, and
the trainer's step putting them into the actor's update (the real `Trainer.step` around recording stand-ins)."""
from __future__ import annotations

import math

import pytest
import torch

from recipe.algos import PolicyLossConfig, RolloutCorrectionConfig, policy_loss, rollout_weights
from tests.test_colocate import make_trainer, prompts

pytestmark = pytest.mark.unit

# Two samples of three response columns; the second has its last column as padding.
_OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
_ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -1.1, 0.0]])  # log-ratios 0.5, -1.0, 0 | -0.8, 0.1
_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_rollout_is_token_and_sequence_weights_by_hand():
    """Contract: token TIS weighs each token by min(exp(old - rollout), threshold); sequence TIS weighs every token
    of a sample by min(exp(sum of its log-ratios), threshold); padding gets 0; the metrics describe the raw weights."""
    w, m = rollout_weights(_OLD, _ROLLOUT, _MASK, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5))
    want = torch.tensor([[min(math.exp(0.5), 1.5), math.exp(-1.0), 1.0], [math.exp(-0.8), math.exp(0.1), 0.0]])
    torch.testing.assert_close(w, want)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.5))
    w, _ = rollout_weights(_OLD, _ROLLOUT, _MASK, RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0))
    torch.testing.assert_close(w, torch.tensor([[math.exp(-0.5)] * 3, [math.exp(-0.7)] * 2 + [0.0]]))


def test_rollout_rs_and_veto_zero_out_what_they_reject():
    """Contract: token RS zeroes tokens whose ratio lies outside [lower, upper]; geometric RS zeroes whole samples by
    exp(mean log-ratio); the veto zeroes a sample holding a token below it; fractions are reported."""
    cfg = RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=1.5)  # lower = 1/1.5
    w, m = rollout_weights(_OLD, _ROLLOUT, _MASK, cfg)
    assert w.tolist() == [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]  # e^0.5 > 1.5, e^-1 and e^-0.8 < 0.667
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
    w, _ = rollout_weights(_OLD, _ROLLOUT, _MASK, RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.5))
    assert w.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]  # exp(-0.5/3), exp(-0.7/2) inside [0.667, 1.5]
    w, m = rollout_weights(_OLD, _ROLLOUT, _MASK, RolloutCorrectionConfig(rollout_token_veto_threshold=0.4))
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]  # e^-1 = 0.37 < 0.4 vetoes the first sample
    assert m["rollout_corr/rollout_veto_fraction"] == 0.5


def _rs(rs: str, threshold: object, **kw: object) -> list[list[float]]:
    """The weights of rejection option(s) `rs` alone on the two samples above."""
    w, _ = rollout_weights(_OLD, _ROLLOUT, _MASK, RolloutCorrectionConfig(rollout_rs=rs, rollout_rs_threshold=threshold,
                                                                          **kw))
    return w.tolist()


def test_v0_9_is_threshold_lower_upper_is_icepop_and_batch_normalize_averages_one():
    """Contract (verl v0.9): rollout_is_threshold "lower_upper" zeroes a weight outside [lower, upper] instead of
    clamping it (IcePop); rollout_is_batch_normalize divides the weights by their mean over the batch's tokens."""
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_1.5")
    w, m = rollout_weights(_OLD, _ROLLOUT, _MASK, cfg)  # ratios e^0.5=1.65, e^-1=0.37, 1 | e^-0.8=0.45, e^0.1
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [0.0, math.exp(0.1), 0.0]]))
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(3 / 5)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    w, m = rollout_weights(_OLD, _ROLLOUT, _MASK, cfg)
    raw = [math.exp(0.5), math.exp(-1.0), 1.0, math.exp(-0.8), math.exp(0.1)]
    mean = sum(raw) / 5
    torch.testing.assert_close(w, torch.tensor([[r / mean for r in raw[:3]], [raw[3] / mean, raw[4] / mean, 0.0]]))
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_batch_normalize=True)  # per sample: e^-0.5, e^-0.7
    w, _ = rollout_weights(_OLD, _ROLLOUT, _MASK, cfg)
    mean = (math.exp(-0.5) + math.exp(-0.7)) / 2
    torch.testing.assert_close(w, torch.tensor([[math.exp(-0.5) / mean] * 3, [math.exp(-0.7) / mean] * 2 + [0.0]]))


def test_v0_9_rejection_options_by_hand():
    """Contract (verl v0.9's rollout_rs options): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r per token, or
    per sample as their sum / mean / max; k1 keeps log lower <= k1 <= log upper, k2 / k3 keep k <= upper; options
    joined by commas must all keep a token, one threshold each."""
    # log r: 0.5, -1.0, 0 | -0.8, 0.1.  k2: 0.125, 0.5, 0 | 0.32, 0.005
    assert _rs("token_k2", 0.3) == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    assert _rs("seq_max_k2", 0.4) == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]  # maxima 0.5 | 0.32
    # k3 means: (e^0.5 - 1.5 + e^-1) / 3 = 0.172 | (e^-0.8 - 0.2 + e^0.1 - 1.1) / 2 = 0.127
    assert _rs("seq_mean_k3", 0.15) == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    # k1 sums: 0.5 | 0.7; verl's k1 bounds exp(-log r) (engine / trainer): both in [1.5, 2.5] (log: 0.405, 0.916)
    assert _rs("seq_sum_k1", "1.5_2.5") == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert _rs("seq_sum_k1", 1.5) == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # upper alone: [1/1.5, 1.5], log 0.405
    # token_k1 on exp(-log r) = 0.61, 2.72, 1 | 2.23, 0.90 in [0.4, 1.2]
    assert _rs("token_k1", "0.4_1.2") == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    assert _rs("token_k2,seq_max_k2", "0.3,0.4") == [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    _, m = rollout_weights(_OLD, _ROLLOUT, _MASK, RolloutCorrectionConfig(rollout_rs="token_k2,seq_max_k2",
                                                                          rollout_rs_threshold="0.3,0.4"))
    assert m["rollout_corr/rollout_rs_token_k2_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 5)


def test_older_rejection_names_mean_what_they_meant():
    """Contract: the older names token / sequence / geometric are token_k1 / seq_sum_k1 / seq_mean_k1, and older
    verl's rollout_rs_threshold_lower still bounds the ratio trainer / engine itself (r in [0.4, 1.2] here: 1.65,
    0.37 rejected; 1, 0.45, 1.11 kept), which v0.9's k1 form would have inverted."""
    assert _rs("token", 2.0) == _rs("token_k1", "0.5_2.0")
    assert _rs("geometric", 1.5) == _rs("seq_mean_k1", 1.5)
    assert _rs("token", 1.2, rollout_rs_threshold_lower=0.4) == [[0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]


@pytest.mark.parametrize(("kw", "match"), [
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "rollout_rs is 'seq_max_k1'"),
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": "0.5_2.0"}, "k2 / k3 option takes one upper bound"),
    ({"rollout_rs": "token_k1,seq_sum_k2", "rollout_rs_threshold": "1,2,3"}, "3 values for 2 rollout_rs options"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2.0_0.5"}, "lower <= upper"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 0.5},
     "goes with an older rollout_rs name"),
    ({"rollout_is": "token", "rollout_is_threshold": "high"}, "rollout_is_threshold is 'high'"),
])
def test_bad_v0_9_forms_are_refused_naming_the_key(kw, match):
    """Contract: an unknown option, a lower bound where none is taken, a threshold count that fits no option list,
    an inverted or unparsable bound are refused at construction, naming algorithm.rollout_correction's key."""
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig(**kw)


def test_policy_loss_applies_rollout_weights_per_token():
    """Contract: with `rollout_is_weights` in the micro-batch, each token's policy loss is multiplied by its weight
    (a zero weight removes the token's gradient)."""
    cfg = PolicyLossConfig(loss_agg_mode="token-mean")
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mb = {"log_probs": log_probs, "old_log_probs": torch.tensor([[-1.0, -2.0, -0.5]]),
          "advantages": torch.tensor([[1.0, -1.0, 2.0]]), "response_mask": torch.ones(1, 3, dtype=torch.long),
          "global_token_count": 3, "global_seq_count": 1}
    plain, _ = policy_loss(mb, cfg)
    weighted, _ = policy_loss({**mb, "rollout_is_weights": torch.tensor([[0.5, 0.0, 2.0]])}, cfg)
    assert plain.item() == pytest.approx(-(1.0 - 1.0 + 2.0) / 3)
    assert weighted.item() == pytest.approx(-(0.5 * 1.0 + 0.0 + 2.0 * 2.0) / 3)
    weighted.backward()
    assert log_probs.grad[0, 1].item() == 0.0


def test_the_trainer_weighs_the_actor_update_and_logs_the_correction(tmp_path):
    """Contract: with rollout_is=token, the batch that update_policy receives carries each sampled token's truncated
    weight from the engine's log-probs (-0.5 here) against the actor's old log-probs (0 here: ratio e^0.5, cut to
    1.5), 0 elsewhere, and the step logs rollout_corr/* metrics; without the key there is no weight."""
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    trainer, _ = make_trainer(tmp_path / "on", ["algorithm.rollout_correction.rollout_is=token",
                                                "algorithm.rollout_correction.rollout_is_threshold=1.5"], colocated=False)
    metrics = trainer.step(1, prompts)
    batch = trainer.workers.actor.batches["update_policy"]
    mask = batch["response_mask"].bool()
    assert torch.allclose(batch["rollout_is_weights"][mask], torch.tensor(1.5))
    assert (batch["rollout_is_weights"][~mask] == 0).all()
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(math.exp(0.5), rel=1e-5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0
    trainer.close()
    trainer, _ = make_trainer(tmp_path / "off", [], colocated=False)
    metrics = trainer.step(1, prompts)
    assert "rollout_is_weights" not in trainer.workers.actor.batches["update_policy"]
    assert not any(k.startswith("rollout_corr/") for k in metrics)
    trainer.close()
