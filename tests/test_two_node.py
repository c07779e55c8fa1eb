"""Two nodes: the driver joins an existing Ray cluster, Megatron trains on one node, the engines serve
on the other, and weights cross by the distributed (process-group) path.

`ray.cluster_utils.Cluster` simulates the two nodes on this machine. Each node declares one
logical GPU (so the separate placement's two pools must land on different nodes, as on a real
cluster) and a custom resource naming it, so the test can tell the nodes apart.
"""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.config_schema import PPOConfig
from recipe.tasks import gsm8k
from tests.test_trainer_e2e import CONFIG_DIR, RECORDS, actor_log_probs, probe


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    """Start a 2-node cluster, join it through RAY_ADDRESS, build a separate-placement cpu_tiny run, probe the
    engine, train one step, probe again; then shut everything down."""
    import os

    import ray
    from ray.cluster_utils import Cluster
    from transformers import AutoTokenizer

    from recipe.main_ppo import build

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "resources": {"node_a": 1},
                                                             "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    root = tmp_path_factory.mktemp("two_node")
    for split in gsm8k.SPLITS:
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    data = gsm8k.preprocess(root / "data", root)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="cpu_tiny", overrides=[
            f"data.train_files=[{data['train']}]", f"trainer.default_local_dir={root / 'out'}",
            "trainer.total_training_steps=1", "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"])
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    os.environ["RAY_ADDRESS"] = cluster.address
    trainer = None
    try:
        trainer, batches = build(PPOConfig.from_dict(config_dict), config_dict)
        engine = trainer.workers.engines[0]
        tok = AutoTokenizer.from_pretrained(str(root / "out" / "tiny_model"))
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 boxes of 4 apples."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
        before = probe(engine, prompt_ids)
        trainer.fit(batches)
        after = probe(engine, prompt_ids)
        placement = trainer.workers.placement
        node_of = {pool: ray.util.placement_group_table(pgs[0])["bundles_to_node_id"][0]
                   for pool, pgs in placement.groups.items()}
        labels = {n["NodeID"]: [r for r in ("node_a", "node_b") if r in n["Resources"]][0] for n in ray.nodes()}
        return {
            "nodes": len(ray.nodes()), "pools": {pool: labels[node] for pool, node in node_of.items()},
            "rank_nodes": {labels[info.node_id] for info in trainer.workers.actor.ranks},
            "mode": trainer.workers.weight_sync.mode, "colocated": trainer.workers.colocated,
            "before": before, "after": after, "engine_version": engine.weight_version,
            "actor_on_after": actor_log_probs(trainer, prompt_ids, after[0]),
            "actor_on_before": actor_log_probs(trainer, prompt_ids, before[0]),
        }
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        if trainer is not None:
            trainer.close()
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.e2e
def test_trainer_step_across_two_nodes_by_the_distributed_path(two_node_run):
    """Contract: with RAY_ADDRESS set the driver joins the existing 2-node cluster; in separate placement the
    Megatron ranks run on one node and the engine on the other; a whole trainer step syncs the weights by the
    distributed path, after which the engine's log-probs of a sampled response equal the actor's within
    1e-3, while the actor no longer gives the initial engine's log-probs (the sync did something)."""
    r = two_node_run
    assert r["nodes"] == 2
    assert r["pools"]["trainer"] != r["pools"]["rollout"] and r["rank_nodes"] == {r["pools"]["trainer"]}
    assert r["mode"] == "distributed" and not r["colocated"]
    assert r["before"][2] == 0 and r["engine_version"] == 1 and r["after"][2] == 1
    ids, engine_lp, _ = r["after"]
    assert len(ids) == len(engine_lp) > 0
    assert max(abs(a - b) for a, b in zip(engine_lp, r["actor_on_after"])) < 1e-3
    assert max(abs(a - b) for a, b in zip(r["before"][1], r["actor_on_before"])) > 1e-2
