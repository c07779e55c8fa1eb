"""The hybrid memory plan (`recipe.memory_plan`): what each GPU holds in each phase, checked before Ray starts.

Contract: the GSM8K preset's layout for Qwen2.5-3B fits an 80 GB GPU with its offload keys on, in the rollout, the
weight sync, a checkpoint and training; plans that cannot fit are refused naming the keys to change.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.config_schema import ConfigError, PPOConfig
from recipe.memory_plan import GIB, check_memory, parameter_count, plan_memory
from recipe.placement import plan_placement

pytestmark = pytest.mark.unit

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "recipe" / "config")
QWEN25_3B = {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
             "intermediate_size": 11008, "vocab_size": 151936, "tie_word_embeddings": True}  # its config.json
GPU_80GB = 80 * 10**9
OFFLOAD = ["actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
           "actor_rollout_ref.actor.megatron.optimizer_offload=true"]


def preset(tmp_path, overrides):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="gsm8k_qwen2_5_3b", overrides=[
            f"data.train_files=[{data}]", f"data.val_files=[{data}]", *overrides])
    cfg = PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    return cfg, plan_placement(cfg)


def test_qwen_3b_preset_fits_an_80gb_gpu(tmp_path, caplog):
    """Contract: 3.1B parameters at TP=2 x DP=4 in bf16 (actor + reference): ~3.1 GiB of params and ~5.7 GiB of
    fp32 grads per GPU, the distributed optimizer's fp32 state over DP; all of it offloaded during the rollout, the
    engine's half of the GPU leaves a KV cache of tens of GiB; the plan is logged."""
    assert abs(parameter_count(QWEN25_3B) - 3.09e9) < 0.02e9
    cfg, plan = preset(tmp_path, OFFLOAD)
    with caplog.at_level("INFO"):
        memory = check_memory(cfg, plan, QWEN25_3B, GPU_80GB)
    assert "memory plan per GPU" in caplog.text
    assert memory.params == pytest.approx(2 * 3.09e9 / 2 * 2, rel=0.02)  # actor + ref shards, 2 bytes each
    assert memory.grads == pytest.approx(3.09e9 / 2 * 4, rel=0.02)
    assert memory.optimizer == pytest.approx(3.09e9 / 2 * 12 / 4, rel=0.02)
    assert memory.offloaded == memory.state
    assert memory.kv_cache > 30 * GIB and memory.rollout_free > 0 and memory.training_free > 40 * GIB
    # the weight sync: the actor's bf16 shard back on the GPU, two 512 MiB buckets, the embedding twice in bf16
    assert memory.sync_extra == pytest.approx(3.09e9 / 2 * 2 + 2 * 2**29 + 2 * 151936 * 2048 * 2, rel=0.02)
    assert memory.sync_free > 50 * GIB
    assert memory.onloaded_params == pytest.approx(3.09e9 / 2 * 2, rel=0.02)  # the actor's shard, for its checkpoint
    assert 0 < memory.checkpoint_free < memory.rollout_free


def test_plans_that_cannot_fit_are_refused_naming_the_keys(tmp_path):
    """Contract: resident training state next to a large engine share, an engine share smaller than its weights,
    weight-sync buckets that do not fit next to the engine's weights, an engine share that leaves no room for the
    parameters a checkpoint brings back, and training state larger than the GPU are each refused with the keys to change; fp32 costs more than bf16."""
    resident = [k.replace("=true", "=false") for k in OFFLOAD]  # the preset offloads; keep the state resident
    cfg, plan = preset(tmp_path, [*resident, "actor_rollout_ref.rollout.gpu_memory_utilization=0.9"])
    with pytest.raises(ConfigError, match="param_offload=true.*gpu_memory_utilization"):
        plan_memory(cfg, plan, QWEN25_3B, GPU_80GB).check()
    cfg, plan = preset(tmp_path, OFFLOAD + ["actor_rollout_ref.rollout.gpu_memory_utilization=0.03"])
    with pytest.raises(ConfigError, match="no room for a KV cache"):
        plan_memory(cfg, plan, QWEN25_3B, GPU_80GB).check()
    cfg, plan = preset(tmp_path, [*OFFLOAD, "actor_rollout_ref.rollout.gpu_memory_utilization=0.93"])
    with pytest.raises(ConfigError, match="saving a checkpoint does not fit.*gpu_memory_utilization"):
        plan_memory(cfg, plan, QWEN25_3B, GPU_80GB).check()
    cfg, plan = preset(tmp_path, [*OFFLOAD, "actor_rollout_ref.rollout.update_weights_bucket_megabytes=40000"])
    with pytest.raises(ConfigError, match="weight sync does not fit.*update_weights_bucket_megabytes"):
        plan_memory(cfg, plan, QWEN25_3B, GPU_80GB).check()
    cfg, plan = preset(tmp_path, OFFLOAD)
    with pytest.raises(ConfigError, match="training does not fit.*tensor_model_parallel_size"):
        plan_memory(cfg, plan, QWEN25_3B, 16 * 10**9).check()
    fp32, _ = preset(tmp_path, OFFLOAD + ["actor_rollout_ref.actor.megatron.dtype=float32"])
    assert plan_memory(fp32, plan, QWEN25_3B, GPU_80GB).params == 2 * plan_memory(cfg, plan, QWEN25_3B, GPU_80GB).params
    assert check_memory(cfg, plan, QWEN25_3B, None) is None  # no GPU on the driver: nothing to plan


def test_a_reference_in_its_own_layout_is_planned_by_its_own_shard(tmp_path):
    """Contract: the 3B preset's reference at TP=1 (actor TP=2) holds a whole copy of the model per GPU (params only,
    no grads or optimizer), and the plan still fits the 80 GB GPU and is placed on the actor's bundles."""
    cfg, plan = preset(tmp_path, [*OFFLOAD, "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"])
    assert plan.roles == ("actor", "ref") and cfg.role_dp_size(cfg.workers()["ref"]) == 8
    memory = check_memory(cfg, plan, QWEN25_3B, GPU_80GB)
    assert memory.params == pytest.approx(3.09e9 / 2 * 2 + 3.09e9 * 2, rel=0.02)  # actor's half + ref's whole
    assert memory.grads == pytest.approx(3.09e9 / 2 * 4, rel=0.02)
    assert memory.training_free > 0
