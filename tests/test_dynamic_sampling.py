"""Dynamic sampling (`algorithm.filter_groups.*`, DAPO's filter): groups whose samples all score the same are dropped
and more prompt batches rolled out until the step holds `data.train_batch_size` groups that differ (the real
`Trainer.step` around recording stand-ins)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from recipe.algos import AlgorithmConfig
from recipe.engine_faults import RunFailed
from tests.test_colocate import FakeAgentLoop, make_trainer

pytestmark = pytest.mark.unit


class MixedAgentLoop(FakeAgentLoop):
    """Prompts named `*-mixed` get one right sample per group ('#### 4'); every other prompt's samples are all
    wrong, so their groups carry no signal."""

    async def generate(self, prompts, greedy=False, seed=None, over_sample_rate=0.0):
        trajs = await super().generate(prompts, greedy, seed, over_sample_rate)
        for t in trajs:
            right = t.prompt_uid.endswith("-mixed") and t.sample_index == 0
            t.messages = [t.messages[0], {"role": "assistant", "content": "#### 4" if right else "#### 5"}]
        return trajs


def batches(*names: list[str]):
    it = iter([SimpleNamespace(prompts=list(n), epoch=0) for n in names])
    return lambda: next(it)


def test_uniform_groups_dropped_and_the_batch_refilled(tmp_path):
    """Contract: with filter_groups on (metric=score), groups without a score spread are dropped and further prompt
    batches are rolled out until train_batch_size (4) groups differ; the update trains on exactly those groups,
    and the kept / dropped groups and generation batches are logged."""
    trainer, events = make_trainer(tmp_path, ["algorithm.filter_groups.enable=true",
                                              "algorithm.filter_groups.metric=score"], colocated=False,
                                   loop_cls=MixedAgentLoop)
    draw = batches(["p0-mixed", "p1", "p2", "p3"], ["a-mixed", "b", "c", "d-mixed"], ["e-mixed", "f", "g", "h-mixed"])
    metrics = trainer.step(1, draw)
    assert events.count("rollout") == 3
    batch = trainer.workers.actor.batches["update_policy"]
    assert batch["responses"].shape[0] == 8  # 4 groups x 2 samples
    assert metrics["rollout/filter_groups/kept_groups"] == 4
    assert metrics["rollout/filter_groups/dropped_groups"] == 7  # p1-p3, b, c, f, g
    assert metrics["rollout/filter_groups/gen_batches"] == 3
    trainer.close()


def test_generation_limit_stops_the_run_when_the_data_cannot_fill_the_batch(tmp_path):
    """Contract (verl's behaviour): max_num_gen_batches bounds the batches rolled out per step; reaching it with fewer
    than train_batch_size groups kept (here 2 of 4) stops the run with one line naming the key, before any update."""
    trainer, events = make_trainer(tmp_path, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                                              "algorithm.filter_groups.max_num_gen_batches=2"], colocated=False,
                                   loop_cls=MixedAgentLoop)
    draw = batches(["p0-mixed", "p1", "p2", "p3"], ["a-mixed", "b", "c", "d"], ["e-mixed"])
    with pytest.raises(RunFailed, match=r"step 1: dynamic sampling kept 2 of data.train_batch_size=4 groups with a "
                                        r"score spread in 2 prompt batches \(algorithm.filter_groups.max_num_gen_"
                                        r"batches=2\)"):
        trainer.step(1, draw)
    assert events.count("rollout") == 2 and "update_policy" not in trainer.workers.actor.batches
    trainer.close()


def test_filter_groups_needs_a_metric():
    """Contract: enabling the filter without a metric is refused naming the key and the choices."""
    with pytest.raises(ValueError, match=r"algorithm\.filter_groups\.metric is None.*'acc', 'score', 'seq_reward'"):
        AlgorithmConfig(filter_groups={"enable": True})
