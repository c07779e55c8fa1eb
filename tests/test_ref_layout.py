"""The reference policy in a layout of its own (verl's actor_rollout_ref.ref.megatron.*): `build_workers` gives each
Megatron role its own TP x PP x DP group on the same bundles (the log-prob parity across layouts is
tests/test_actor.py's)."""
from __future__ import annotations

import pytest

from tests.test_colocate import FakeEngine, FakeGroup, FakeSync, make_trainer


@pytest.mark.unit
def test_each_role_gets_its_own_layout_on_the_same_ranks(tmp_path, monkeypatch):
    """Contract: on 2 ranks with the actor at TP=2 and the reference at TP=1, build_workers starts the actor as
    TP2 x DP1 and the reference as TP1 x DP2, both over every rank's bundle, the reference forward-only with the
    actor's other settings; the critic keeps its own critic.megatron layout; the batch splits over every role."""
    import transformers

    from megatron_workers import worker_group
    from recipe import main_ppo, weight_sync
    from recipe.placement import plan_placement
    from rollout.engines import engine_actor

    events: list[str] = []
    started: dict[str, tuple] = {}

    class Group(FakeGroup):
        def __init__(self, layout, rank_options, name: str, **kwargs) -> None:
            super().__init__(name, events)
            self.ranks = []
            started[name] = (layout.tp, layout.pp, layout.dp, rank_options)

        def build(self, factory) -> None:
            started[self.name] += (factory.args[1],)  # the role's config

    class Placement:
        use_gpus = False

        def __init__(self, plan) -> None:
            self.plan = plan

        def rank_options(self, role: str) -> list[int]:
            return [self.plan.rank_bundle(r).gpu for r in range(self.plan.world_size)]

        def check_ranks(self, role, gpu_ids) -> None: ...
        def engine_options(self, i: int) -> dict: return {}

    monkeypatch.setattr(worker_group, "MegatronWorkerGroup", Group)
    monkeypatch.setattr(main_ppo, "Placement", Placement)
    monkeypatch.setattr(engine_actor.EngineClient, "launch", staticmethod(lambda path, name, **kw: FakeEngine(name, events)))
    monkeypatch.setattr(weight_sync, "WeightSync", lambda *args, **kwargs: FakeSync(events))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", staticmethod(lambda path, **kwargs: None))
    trainer, _ = make_trainer(tmp_path, ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=2",
                                         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                         "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
                                         "critic.megatron.pipeline_model_parallel_size=2"], colocated=False)
    cfg = trainer.cfg
    main_ppo.build_workers(cfg, "model", plan_placement(cfg))
    trainer.close()
    assert {role: s[:4] for role, s in started.items()} == {
        "actor": (2, 1, 1, [0, 1]), "ref": (1, 1, 2, [0, 1]), "critic": (1, 2, 1, [0, 1])}
    ref = started["ref"][4]
    assert ref.optim is None and ref.megatron.tensor_model_parallel_size == 1
    assert ref.megatron.dtype == cfg.actor_rollout_ref.actor.megatron.dtype == "float32"


@pytest.mark.unit
def test_a_steps_rows_split_over_the_references_dp_ranks(tmp_path):
    """Contract: the rows a step trains on are a multiple of every role's DP size: with one actor mini-batch on one
    DP rank (TP=2) and the reference on 2 DP ranks (TP=1), a multiple of 2, so the reference's pass splits evenly."""
    from recipe import launch

    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    base = ["--config-name", "cpu_tiny", f"data.train_files=[{data}]", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    assert launch.load(base)[0].batch_multiple == 1
    assert launch.load([*base, "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"])[0].batch_multiple == 2
