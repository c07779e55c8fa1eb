"""MegatronWorkerGroup: batch splitting, layout refusals before any actor starts, rank wiring."""
from __future__ import annotations

import time

import pytest
import torch

from megatron_workers.worker_group import ParallelLayout, concat_results, split_batch
from tests.conftest import local_ray_cluster


@pytest.mark.unit
def test_split_batch_is_mini_batch_aware_and_concat_inverts_contiguous_split():
    """Contract: with n mini-batches, DP shard d holds piece d of every mini-batch in order, so a
    rank's local mini-batch i is part of global mini-batch i for any DP size; with one
    mini-batch, concatenating the shards in DP order gives the batch back."""
    batch = {"x": torch.arange(12), "y": torch.arange(24).view(12, 2)}
    shards = split_batch(batch, dp=2, num_mini_batches=3)
    assert shards[0]["x"].tolist() == [0, 1, 4, 5, 8, 9]
    assert shards[1]["x"].tolist() == [2, 3, 6, 7, 10, 11]
    assert shards[1]["y"][0].tolist() == [4, 5]
    whole = concat_results(split_batch(batch, dp=3))
    assert torch.equal(whole["x"], batch["x"]) and torch.equal(whole["y"], batch["y"])


@pytest.mark.unit
def test_split_batch_refuses_indivisible_or_ragged_batches():
    """Contract: a batch that cannot be split evenly, or whose tensors disagree on the batch size,
    is refused with the sizes and the fix."""
    with pytest.raises(ValueError, match="multiple of 4"):
        split_batch({"x": torch.arange(6)}, dp=2, num_mini_batches=2)
    with pytest.raises(ValueError, match="disagree on the batch dimension"):
        split_batch({"x": torch.arange(6), "y": torch.arange(5)}, dp=1)


@pytest.mark.unit
def test_parallel_layout_rejects_non_positive_sizes():
    """Contract: a layout with a size < 1 is refused naming the field."""
    assert ParallelLayout(tp=2, pp=2, dp=3).world_size == 12
    with pytest.raises(ValueError, match="ParallelLayout.pp"):
        ParallelLayout(pp=0)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory, num_cpus=2, pickle_by_value=__name__):
        yield


@pytest.mark.integration
def test_layouts_that_do_not_fit_are_refused_before_any_actor_starts(ray_cluster, tiny_model_dir):
    """Contract: TP not dividing the heads or PP not dividing the layers is refused with a clear
    error before any actor starts, and rank options the cluster cannot place are refused after a
    timeout with no actor left (a run's options come from recipe.placement, checked before Ray)."""
    import ray
    from transformers import AutoConfig

    from megatron_workers.worker_group import MegatronWorkerGroup

    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp=3"):
        MegatronWorkerGroup(ParallelLayout(tp=3), hf_config=hf_config)
    with pytest.raises(ValueError, match="num_hidden_layers=2 is not divisible by pp=4"):
        MegatronWorkerGroup(ParallelLayout(pp=4), hf_config=hf_config)
    with pytest.raises(RuntimeError, match="rank 0 did not start within 2s"):
        MegatronWorkerGroup(ParallelLayout(tp=2), [{"num_cpus": 0.25, "num_gpus": 1}] * 2, ready_timeout_s=2)
    with pytest.raises(ValueError, match="1 rank_options for a layout of 2 ranks"):
        MegatronWorkerGroup(ParallelLayout(tp=2), [{"num_cpus": 0.25}])
    assert ray.available_resources().get("CPU") == 2  # no actor holds a CPU share


class Probe:
    """A role that reports what each rank sees."""

    def where(self) -> dict:
        import importlib.util

        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        return {
            "flash_mla": importlib.util.find_spec("flash_mla").origin,  # the CPU stand-in without a GPU
            "world_sum": float(t),
            "tp_world": mpu.get_tensor_model_parallel_world_size(),
        }

    def echo(self, shard: dict) -> dict:
        return shard

    def all_reduce(self, skip_rank: int = -1, exit_rank: int = -1) -> float:
        """An all-reduce that rank `skip_rank` never joins (it returns) and rank `exit_rank` dies in."""
        import os

        import torch.distributed as dist

        if dist.get_rank() == exit_rank:
            os._exit(1)
        if dist.get_rank() == skip_rank:
            return 0.0
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)


@pytest.mark.integration
def test_group_wires_ranks_and_dispatches_by_dp_rank(ray_cluster):
    """Contract: a TP2 x DP2 group initialises gloo + Megatron groups in every actor (they see the
    CPU import stand-ins), reports each rank's coordinates, and dispatch returns each DP shard
    from exactly one collector rank, in DP order."""
    import cpu_standins
    from megatron_workers.worker_group import MegatronWorkerGroup

    group = MegatronWorkerGroup(ParallelLayout(tp=2, dp=2))
    try:
        coords = sorted((r.tp_rank, r.pp_rank, r.dp_rank) for r in group.ranks)
        assert coords == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
        assert sum(r.is_collector for r in group.ranks) == 2
        assert len({r.node_id for r in group.ranks}) == 1 and all(r.gpu_ids == () for r in group.ranks)
        group.build(Probe)
        seen = group.call_all("where")
        assert all(s["world_sum"] == 6.0 and s["tp_world"] == 2 for s in seen)
        if not cpu_standins.gpu_present():
            assert all(s["flash_mla"].startswith(str(cpu_standins.STANDIN_DIR)) for s in seen)
        batch = {"x": torch.arange(8)}
        out = group.dispatch("echo", batch)
        assert [o["x"].tolist() for o in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert torch.equal(concat_results(out)["x"], batch["x"])
    finally:
        group.shutdown()


@pytest.mark.integration
def test_a_hung_collective_or_a_dead_rank_stops_the_call_naming_role_and_rank(ray_cluster):
    """Contract (faults): a collective one rank never joins fails past collective_timeout_s, and a rank that dies
    mid-call fails the call at once; both as RankFailure naming the group's role, the rank and its coordinates (the
    dead rank, not the peer it left waiting); shutdown then frees every actor; a role's own error keeps its type."""
    import ray

    from megatron_workers.worker_group import MegatronWorkerGroup, RankFailure

    group = MegatronWorkerGroup(ParallelLayout(tp=2), name="actor", collective_timeout_s=8)
    try:
        group.build(Probe)
        assert group.call_all("all_reduce") == [2.0, 2.0]
        with pytest.raises(TypeError, match="echo"):
            group.call_all("echo")  # missing argument: the role's error, not a fault
        with pytest.raises(RankFailure, match=r"Megatron actor rank 0 \(tp 0, pp 0, dp 0\) failed in all_reduce: "
                                              r"RuntimeError: .*Timed out"):
            group.call_all("all_reduce", skip_rank=1)
        with pytest.raises(RankFailure, match=r"Megatron actor rank 1 \(tp 1, pp 0, dp 0\) died during all_reduce"):
            group.call_all("all_reduce", exit_rank=1)
    finally:
        group.shutdown()
    for _ in range(120):  # ray.kill frees an actor's resources asynchronously
        if ray.available_resources().get("CPU") == 2:
            break
        time.sleep(0.5)
    assert ray.available_resources().get("CPU") == 2  # no rank left behind
