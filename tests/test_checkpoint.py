"""Megatron's distributed optimizer on this machine and resume checkpoints (every Adam moment, sharded or not) of a
Megatron actor group (real Megatron ranks on Ray). HF export is tests/test_export_hf.py's."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_workers.actor import MegatronActor
from tests.conftest import local_ray_cluster
from tests.test_actor import build_actor, hf_weights, ppo_batch, update


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import cloudpickle

    with local_ray_cluster(tmp_path_factory, num_cpus=4, pickle_by_value="tests.test_actor"):
        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _OptimizerProbe travels by value too
        yield


class _OptimizerProbe(MegatronActor):
    """A MegatronActor that reports how much Adam state its rank holds."""

    def adam_state_numel(self) -> int:
        return sum(state["exp_avg"].numel() + state["exp_avg_sq"].numel()
                   for opt in self.optimizer.chained_optimizers for state in opt.optimizer.state.values())


@pytest.mark.integration
def test_distributed_optimizer_shards_adam_over_dp_and_trains_like_the_plain_one(ray_cluster, tiny_model_dir):
    """Contract: with optim.use_distributed_optimizer at DP=2 each rank holds about half of the Adam moments, and two
    optimizer steps give the plain optimizer's metrics and weights (to float32 rounding: the gradient reduction
    order differs)."""
    from megatron_workers.config import OptimConfig
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout

    batch = ppo_batch(tiny_model_dir, seed=5)
    results = {}
    group = MegatronWorkerGroup(ParallelLayout(dp=2), seed=1)
    try:
        for distributed in (True, False):  # the same processes, the actor built afresh
            optim = OptimConfig(lr=1e-3, adam_eps=1e-4, clip_grad=0.5, use_distributed_optimizer=distributed)
            build_actor(group, tiny_model_dir, role_cls=_OptimizerProbe, ppo_micro_batch_size_per_gpu=2, optim=optim)
            metrics = update(group, batch, mini_batch_size=4)
            results[distributed] = metrics, hf_weights(group), group.call_all("adam_state_numel")
    finally:
        group.shutdown()
    (dist_m, dist_w, dist_numel), (plain_m, plain_w, plain_numel) = results[True], results[False]
    params = sum(v.numel() for v in plain_w.values())
    assert plain_numel == [2 * params] * 2  # each rank: exp_avg and exp_avg_sq of every parameter
    assert sum(dist_numel) == 2 * params and max(dist_numel) - min(dist_numel) <= 0.1 * params
    assert dist_m.keys() == plain_m.keys()
    for k in dist_m:
        assert dist_m[k] == pytest.approx(plain_m[k], rel=1e-5), k
    for k, v in plain_w.items():
        torch.testing.assert_close(dist_w[k], v, rtol=0, atol=1e-6, msg=f"{k} differs")


def _train_cfg():
    from megatron_workers.config import OptimConfig

    # warm-up over the steps taken, so the scheduler state matters for the resumed step
    return dict(ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-3, lr_warmup_steps=3, adam_eps=1e-4, clip_grad=0.5))


@pytest.mark.integration
def test_resume_is_bit_identical_and_layout_checked(ray_cluster, tiny_model_dir, tmp_path):
    """Contract: train to step k at PP=2 x DP=2 with the distributed optimizer, save, load into a fresh group (new
    processes), step again: the weights and metrics are bit-identical to not stopping (so every Adam moment shard
    came back); a checkpoint refuses to load into another layout, naming both layouts."""
    import ray

    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout

    first, second = ppo_batch(tiny_model_dir, seed=5), ppo_batch(tiny_model_dir, seed=6)
    ckpt = tmp_path / "ckpt"
    layout = ParallelLayout(tp=1, pp=2, dp=2)
    group = MegatronWorkerGroup(layout, seed=1)
    try:
        build_actor(group, tiny_model_dir, **_train_cfg())
        warmup_metrics = update(group, first, mini_batch_size=4)  # steps 1 and 2
        group.call_all("save_checkpoint", str(ckpt))
        cont_metrics = update(group, second, mini_batch_size=4)  # steps 3 and 4
        cont = hf_weights(group)
    finally:
        group.shutdown()

    group = MegatronWorkerGroup(layout, seed=7)  # fresh processes, different seed
    try:
        build_actor(group, tiny_model_dir, **_train_cfg())
        assert group.call_all("load_checkpoint", str(ckpt)) == [2] * 4
        resumed_metrics = update(group, second, mini_batch_size=4)
        resumed = hf_weights(group)
    finally:
        group.shutdown()
    assert resumed_metrics == cont_metrics
    # linear warm-up from 0 over 3 steps: steps 1, 2 use 0 and 1/3 of the peak, steps 3, 4 use 2/3 and 1
    assert warmup_metrics["actor/lr"] == pytest.approx(1e-3 / 6)
    assert cont_metrics["actor/lr"] == pytest.approx(1e-3 * 5 / 6)
    for k in cont:
        assert torch.equal(resumed[k], cont[k]), f"{k} differs after resume"

    other = MegatronWorkerGroup(ParallelLayout(tp=1, pp=1), seed=1)
    try:
        build_actor(other, tiny_model_dir, **_train_cfg())
        with pytest.raises(ray.exceptions.RayTaskError, match="saved with layout .*'pp': 2.* but this group is .*'pp': 1"):
            other.call_all("load_checkpoint", str(ckpt))
    finally:
        other.shutdown()


