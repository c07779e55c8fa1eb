"""MFU (recipe.flops): the FLOP count against a hand computation, the peak lookup, and `perf/mfu/actor` in a step."""
from __future__ import annotations

import pytest

from recipe.flops import MFU, ModelFlops, peak_tflops

# Qwen2.5-0.5B's config (its published config.json, tied embeddings)
QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}


@pytest.mark.unit
def test_flops_of_qwen2_5_0_5b_by_hand():
    """Contract: N = per layer q/o (896 x 896 each) + k/v (896 x 128 each) + MLP (3 x 896 x 4864), times 24 layers,
    plus the LM head (151936 x 896): 493,961,216, i.e. Qwen2.5-0.5B's 494,032,768 parameters less its q/k/v biases
    (24 x 1152) and norms (49 x 896); training FLOPs = 6 N tokens + 12 x 24 x 896 x sum(s^2)."""
    m = ModelFlops.from_hf_config(QWEN25_05B)
    per_layer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    assert m.matmul_params == 24 * per_layer + 151936 * 896 == 493_961_216 == 494_032_768 - 24 * 1152 - 49 * 896
    assert m.attention_width == 24 * 14 * 64
    assert m.training([100, 300]) == 6 * 493_961_216 * 400 + 12 * 21_504 * (100 ** 2 + 300 ** 2)
    # 2 epochs over those 400 tokens in 0.5 s on 8 devices of 989 TFLOPS
    mfu = MFU(m, peak_tflops=989.0, devices=8).of_update([100, 300], epochs=2, seconds=0.5)
    assert mfu == pytest.approx(2 * 1_211_311_718_400 / (0.5 * 8 * 989e12), rel=1e-12)
    assert m.training([100, 300]) == 1_211_311_718_400


@pytest.mark.unit
def test_peak_comes_from_the_key_else_the_gpu_type_else_nothing(caplog):
    """Contract: trainer.peak_tflops_per_gpu wins; else the datasheet table by Ray's accelerator type; a CPU run
    (no accelerator) or an unlisted GPU gets no peak (so no MFU), the latter with a warning naming the key."""
    assert peak_tflops(500.0, "H100") == 500.0
    assert peak_tflops(None, "H100") == 989.0 and peak_tflops(None, "A100-80G") == 312.0
    assert peak_tflops(None, None) is None
    assert peak_tflops(None, "GeForce-RTX-9999") is None
    assert "trainer.peak_tflops_per_gpu" in caplog.text
    assert MFU.for_run(QWEN25_05B, None, devices=1) is None  # this CPU machine, no key: no made-up MFU
    assert MFU.for_run(QWEN25_05B, 2.0, devices=1).peak_tflops == 2.0


@pytest.mark.unit
def test_step_logs_mfu_of_the_actor_update(tmp_path):
    """Contract: with a known peak, a trainer step logs perf/mfu/actor = the update's FLOPs over its
    timing/update_actor_s x devices x peak, next to perf/throughput; without one it logs none."""
    from tests.test_colocate import make_trainer, prompts

    trainer, _ = make_trainer(tmp_path, [], colocated=False)
    assert trainer.mfu is None and "perf/mfu/actor" not in trainer.step(1, prompts)
    model = ModelFlops(matmul_params=1000, attention_width=10)
    trainer.mfu = MFU(model, peak_tflops=1e-9, devices=1)
    m = trainer.step(2, prompts)
    seq_lens = [6] * int(m["rollout/num_trajectories"])  # the fake rollout: 3 prompt + 3 sampled tokens each
    expected = model.training(seq_lens) / (m["timing/update_actor_s"] * 1e-9 * 1e12)
    assert m["perf/mfu/actor"] == pytest.approx(expected, rel=1e-9) and "perf/throughput" in m
    trainer.close()
