"""Placement: one plan for every role, checked before Ray starts, that a cluster schedules at once.

The GPU cases run on a fake 8-GPU node: `ray.init(num_gpus=8)` declares logical GPUs on a CPU
machine, and Ray hands out GPU ids for them exactly as it would for real ones.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.config_schema import ConfigError, PPOConfig
from recipe.placement import TRAINER, Placement, plan_placement

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "recipe" / "config")
VERL_LIKE = [  # actor (and critic) TP2 x PP2 x DP2 on one 8-GPU node, engines at TP2
    "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
    "critic.megatron.tensor_model_parallel_size=2", "critic.megatron.pipeline_model_parallel_size=2",
]
GRPO_KL = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"]
PPO = ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=false"]
PPO_KL = ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    path.write_bytes(b"")  # validation only checks that the file exists
    return str(path)


def config(data_file: str, overrides: list[str]) -> PPOConfig:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"data.train_files=[{data_file}]", f"actor_rollout_ref.model.path={data_file}", *overrides])
    return PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.unit
def test_hybrid_plan_colocates_every_role_and_engine_on_the_node(data_file):
    """Contract: in hybrid mode actor, ref and critic rank g all sit on GPU g, engine i at TP T uses GPUs
    i*T..i*T+T-1 (base_gpu_id), there are GPUs / T engines, and each engine TP rank's GPU names the
    Megatron rank that hands it its weights."""
    plan = plan_placement(config(data_file, VERL_LIKE + PPO_KL))
    assert plan.hybrid and plan.roles == ("actor", "ref", "critic") and plan.world_size == 8
    assert list(plan.pools) == [TRAINER] and plan.pools[TRAINER].occupants == 4  # 3 roles + 1 engine per GPU
    assert [(e.bundle.node, e.base_gpu_id, e.tp) for e in plan.engines] == [(0, 0, 2), (0, 2, 2), (0, 4, 2), (0, 6, 2)]
    # (engine, TP rank) -> [(stage, filler, serializer)]: stage 0 holds GPUs 0-3, stage 1 GPUs 4-7; the serializer is
    # the rank on the engine rank's GPU, the other stage's filler the same TP position in its own DP replica
    copies = {}
    for c in plan.tensor_copies:
        copies.setdefault((c.engine, c.tp_rank), []).append((c.stage, c.filler, c.serializer))
    assert copies == {(0, 0): [(0, 0, 0), (1, 4, 0)], (0, 1): [(0, 1, 1), (1, 5, 1)],
                      (1, 0): [(0, 2, 2), (1, 6, 2)], (1, 1): [(0, 3, 3), (1, 7, 3)],
                      (2, 0): [(0, 0, 4), (1, 4, 4)], (2, 1): [(0, 1, 5), (1, 5, 5)],
                      (3, 0): [(0, 2, 6), (1, 6, 6)], (3, 1): [(0, 3, 7), (1, 7, 7)]}
    assert [plan.rank_bundle(r).gpu for r in range(8)] == list(range(8))


def assert_handed_over_on_own_gpus(plan) -> int:
    """Every (engine, engine TP rank, stage) has exactly one copy, serialized by the rank on that engine rank's own
    GPU and filled by a rank of that stage with the same TP position (on the same node when the stage has one there);
    returns how many copies are relayed (filler != serializer)."""
    per_stage = plan.world_size // plan.pp
    want = sorted((i, r, s) for i, e in enumerate(plan.engines) for r in range(e.tp) for s in range(plan.pp))
    assert sorted((c.engine, c.tp_rank, c.stage) for c in plan.tensor_copies) == want
    for c in plan.tensor_copies:
        engine = plan.engines[c.engine]
        assert plan.rank_bundle(c.serializer) == type(engine.bundle)(TRAINER, engine.bundle.node,
                                                                      engine.base_gpu_id + c.tp_rank)
        assert c.filler // per_stage == c.stage and c.filler % plan.tp == c.serializer % plan.tp
        node_ranks = [k for k in range(c.stage * per_stage, (c.stage + 1) * per_stage)
                      if plan.rank_bundle(k).node == engine.bundle.node]
        assert (plan.rank_bundle(c.filler).node == engine.bundle.node) == bool(node_ranks)
    return sum(c.filler != c.serializer for c in plan.tensor_copies)


@pytest.mark.unit
def test_each_engine_rank_gets_its_weights_serialized_on_its_own_gpu(data_file):
    """Contract (hybrid, actor TP2, engines at TP2): the payload of engine i's TP rank r for every pipeline stage is
    serialized by the Megatron rank on that same GPU, so no CUDA IPC handle crosses GPUs, and every (engine, TP rank,
    stage) is covered exactly once. At PP=1 that rank also fills it (every DP replica serves the engine on its own
    GPUs); at PP=2 the other stage is filled by a rank of that stage and relayed to it, from the same node on one
    8-GPU node and from the other node on 2 nodes x 4 GPUs, which runs instead of being refused."""
    pp1 = plan_placement(config(data_file, VERL_LIKE[:2] + VERL_LIKE[3:] + GRPO_KL))
    assert assert_handed_over_on_own_gpus(pp1) == 0
    assert [(c.filler, c.serializer) for c in pp1.tensor_copies] == [(g, g) for g in range(8)]
    one_node = plan_placement(config(data_file, VERL_LIKE + GRPO_KL))
    assert assert_handed_over_on_own_gpus(one_node) == 8  # each engine rank's other stage
    two_nodes = plan_placement(config(data_file, VERL_LIKE + GRPO_KL + ["trainer.nnodes=2",
                                                                        "trainer.n_gpus_per_node=4"]))
    assert assert_handed_over_on_own_gpus(two_nodes) == 8
    # stage 0 lies on node 0, stage 1 on node 1: engine 0 (GPUs 0-1 of node 0) gets stage 1 from ranks 4, 5
    assert [(c.stage, c.filler, c.serializer) for c in two_nodes.tensor_copies if c.engine == 0] == [
        (0, 0, 0), (1, 4, 0), (0, 1, 1), (1, 5, 1)]


@pytest.mark.unit
def test_two_node_plans_place_by_node(data_file):
    """Contract: ranks fill node 0 then node 1; engines never straddle nodes; in separate mode the
    engines take their own pool (rollout.nnodes x rollout.n_gpus_per_node) and no tensor senders."""
    plan = plan_placement(config(data_file, VERL_LIKE + GRPO_KL + ["trainer.nnodes=2", "trainer.n_gpus_per_node=4",
                                                                   "actor_rollout_ref.rollout.update_weights_mode=distributed"]))
    assert [(plan.rank_bundle(r).node, plan.rank_bundle(r).gpu) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert [(e.bundle.node, e.base_gpu_id) for e in plan.engines] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    pp1 = plan_placement(config(data_file, VERL_LIKE[:2] + VERL_LIKE[3:] + GRPO_KL + [
        "trainer.nnodes=2", "trainer.n_gpus_per_node=4"]))
    assert [(c.engine, c.tp_rank, c.filler, c.serializer) for c in pp1.tensor_copies] == [
        (i, r, 2 * i + r, 2 * i + r) for i in range(4) for r in range(2)]
    sep = plan_placement(config(data_file, VERL_LIKE + GRPO_KL + [
        "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=4"]))
    assert not sep.hybrid and sep.pools[TRAINER].occupants == 2 and sep.pools["rollout"].occupants == 1
    assert [(e.bundle.pool, e.base_gpu_id) for e in sep.engines] == [("rollout", 0), ("rollout", 2)]
    assert sep.tensor_copies is None


@pytest.mark.unit
def test_configs_that_cannot_fit_are_refused_before_ray_starts(data_file):
    """Contract: an engine TP size that does not divide a node's GPUs, separate mode without a rollout pool,
    or the tensor sync path without shared GPUs is refused by the plan with the key and the fix, and Ray
    was never started."""
    import ray

    with pytest.raises(ConfigError, match=r"rollout.tensor_model_parallel_size=3 does not divide trainer.n_gpus_per_node=8"):
        plan_placement(config(data_file, VERL_LIKE + ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"]))
    with pytest.raises(ConfigError, match=r"rollout.nnodes / rollout.n_gpus_per_node are not set"):
        plan_placement(config(data_file, VERL_LIKE + ["actor_rollout_ref.hybrid_engine=false"]))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=4 does not divide rollout.n_gpus_per_node=2"):
        plan_placement(config(data_file, VERL_LIKE + [
            "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]))
    with pytest.raises(ConfigError, match=r"update_weights_mode=tensor .* use update_weights_mode=distributed"):
        plan_placement(config(data_file, VERL_LIKE + [
            "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=8",
            "actor_rollout_ref.rollout.update_weights_mode=tensor"]))
    assert not ray.is_initialized()


@pytest.mark.unit
def test_an_unknown_sync_path_is_refused_naming_the_key_and_the_paths(data_file):
    """Contract: update_weights_mode is checked against the one registry of sync paths (`recipe.weight_sync.PATHS`)
    when the config is built."""
    import re

    from recipe.weight_sync import PATHS

    with pytest.raises(ConfigError, match=re.escape(f"update_weights_mode is 'nccl'; use one of {tuple(PATHS)}")):
        config(data_file, ["actor_rollout_ref.rollout.update_weights_mode=nccl"])
    for mode in PATHS:
        assert config(data_file, [f"actor_rollout_ref.rollout.update_weights_mode={mode}"])


class Placeholder:
    """Stands in for a Megatron rank or an engine actor: reports what Ray gave it."""

    def where(self) -> dict:
        import os

        import ray

        return {"gpu_ids": [int(i) for i in ray.get_gpu_ids()], "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "node": ray.get_runtime_context().get_node_id()}


@pytest.fixture(scope="module")
def fake_gpu_node(tmp_path_factory):
    """A private Ray cluster of one node with 8 logical GPUs and 4 CPUs."""
    import cloudpickle
    import ray

    ray.init(num_cpus=4, num_gpus=8, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    cloudpickle.register_pickle_by_value(__import__(__name__))
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.integration
def test_fake_8_gpu_node_schedules_every_role_at_once(fake_gpu_node, data_file):
    """Contract: on one 8-GPU node, every Megatron rank of actor, ref and critic and every engine (actor
    TP2 x PP2 x DP2, engines at TP2) starts with exactly the plan's Ray options, nothing waits on a
    placement group, each rank gets the GPU the plan says, each engine sees all GPUs (Ray sets no
    CUDA_VISIBLE_DEVICES for it) while holding the share of its base GPU, and the rank that serializes each
    engine TP rank's weights for the stage on that GPU got that very GPU from Ray."""
    import ray

    plan = plan_placement(config(data_file, VERL_LIKE + PPO_KL))
    placement = Placement(plan, ready_timeout_s=60)
    remote = ray.remote(Placeholder)
    try:
        assert placement.use_gpus
        ranks = {role: [remote.options(**o).remote() for o in placement.rank_options(role)] for role in plan.roles}
        engines = [remote.options(**placement.engine_options(i)).remote() for i in range(len(plan.engines))]
        handles = [h for hs in ranks.values() for h in hs] + engines
        # Everything fits at once: all placeholders answer. The bound is generous: 28 worker processes start two at a
        # time, slowly on a loaded 2-core machine; an unschedulable actor would never answer.
        done, pending = ray.wait([h.where.remote() for h in handles], num_returns=len(handles), timeout=600)
        assert not pending, f"{len(pending)} actor(s) could not be scheduled"
        for role, hs in ranks.items():
            seen = ray.get([h.where.remote() for h in hs])
            assert [s["gpu_ids"] for s in seen] == [[r] for r in range(8)], role
            assert [s["cuda_visible"] for s in seen] == [str(r) for r in range(8)], role
            placement.check_ranks(role, [tuple(s["gpu_ids"]) for s in seen])
        seen = ray.get([h.where.remote() for h in engines])
        assert [s["gpu_ids"] for s in seen] == [[e.base_gpu_id] for e in plan.engines]
        actor_gpus = [s["gpu_ids"] for s in ray.get([h.where.remote() for h in ranks["actor"]])]
        for i, e in enumerate(plan.engines):  # the weight-sync serializer shares the GPU of the engine rank it feeds
            for c in plan.tensor_copies:
                if c.engine == i:
                    assert actor_gpus[c.serializer] == [e.base_gpu_id + c.tp_rank]
        assert all(s["cuda_visible"] is None for s in seen)
        assert all(t["state"] == "CREATED" for t in ray.util.placement_group_table().values()
                   if t["state"] != "REMOVED")
        for h in handles:
            ray.kill(h)
    finally:
        placement.shutdown()


@pytest.mark.integration
@pytest.mark.parametrize("algo", [GRPO_KL, PPO], ids=["grpo_kl", "ppo"])
def test_grpo_kl_and_ppo_fit_one_8_gpu_node(fake_gpu_node, data_file, algo):
    """Contract: GRPO with a KL loss (actor + ref) and PPO (actor + critic) each fit one 8-GPU node next to
    4 TP2 engines: the placement groups are created at once and, on every bundle, the shares the plan's
    processes claim add up to at most the bundle."""
    plan = plan_placement(config(data_file, VERL_LIKE + algo))
    assert len(plan.roles) == 2 and len(plan.engines) == 4
    placement = Placement(plan, ready_timeout_s=60)
    try:
        claimed: dict[int, list[float]] = {}
        for role in plan.roles:
            for r, opts in enumerate(placement.rank_options(role)):
                assert opts["scheduling_strategy"].placement_group_bundle_index == plan.rank_bundle(r).gpu
                claimed.setdefault(plan.rank_bundle(r).gpu, []).append(opts["num_gpus"])
        for i, e in enumerate(plan.engines):
            claimed[e.base_gpu_id].append(placement.engine_options(i)["num_gpus"])
            assert placement.engine_options(i)["runtime_env"]["env_vars"] == {
                "NCCL_MULTI_RANK_GPU_ENABLE": "1", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
        assert all(o["runtime_env"]["env_vars"] == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}  # hybrid: sender + engine rank
                   for role in plan.roles for o in placement.rank_options(role))  # share a GPU in one NCCL group
        assert sorted(claimed) == list(range(8))
        assert all(0 < sum(shares) <= 1 for shares in claimed.values())
    finally:
        placement.shutdown()


@pytest.mark.integration
def test_cluster_without_the_plans_gpus_is_refused_naming_the_keys(fake_gpu_node, data_file):
    """Contract: a plan asking for more GPUs per node than the cluster's nodes have is refused before any
    placement group is created, naming the keys to change."""
    import ray

    before = len(ray.util.placement_group_table())
    plan = plan_placement(config(data_file, VERL_LIKE + ["trainer.nnodes=2",  # PP=2 spans the nodes: no GPU handover
                                                         "actor_rollout_ref.rollout.update_weights_mode=distributed"]))
    with pytest.raises(RuntimeError, match=r"needs nodes with \[8, 8\] GPUs but the Ray cluster's nodes have \[8.0\].*"
                                           r"trainer.nnodes, trainer.n_gpus_per_node"):
        Placement(plan)
    assert len(ray.util.placement_group_table()) == before
