"""Schedules (`async_training.schedule`): one_step_off's rollout ahead, its staleness bound and its resume, with
recorders for the worker groups, the engines and the weight sync around the real `Trainer.fit`."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from recipe.config_schema import ConfigError
from tests.test_colocate import FakeAgentLoop, FakeGroup, make_trainer

pytestmark = pytest.mark.unit

ONE_STEP_OFF = ["async_training.schedule=one_step_off", "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1",
                "rollout.n_gpus_per_node=1"]


class SlowLoop(FakeAgentLoop):
    """A rollout that takes a while (in its event loop), recording when it starts and ends and which prompts and
    weight version it sampled with."""

    async def generate(self, prompts, greedy=False, seed=None, over_sample_rate=0.0):
        self.events.append(f"rollout start {prompts[0].split('/')[0]} v{self.engine_version()}")
        await asyncio.sleep(0.2)
        self.busy_s += 0.2
        trajs = await super().generate(prompts, greedy, seed, over_sample_rate)
        self.events.append(f"rollout end {prompts[0].split('/')[0]}")
        return trajs


class SlowGroup(FakeGroup):
    """An update that takes a while, recording its start and end; `fail_at`: the update that raises."""

    def __init__(self, name, events, fail_at: int | None = None) -> None:
        super().__init__(name, events)
        self.updates, self.fail_at, self.trained = 0, fail_at, []

    def call_all(self, method, *args, **kwargs):
        if method == "save_checkpoint":
            Path(args[0]).mkdir(parents=True)
        return super().call_all(method, *args, **kwargs)

    def dispatch(self, method, batch, mini_batches=None, **kwargs):
        if method != "update_policy":
            return super().dispatch(method, batch, mini_batches, **kwargs)
        self.updates += 1
        if self.updates == self.fail_at:
            raise RuntimeError("rank died")
        self.events.append("update start")
        time.sleep(0.2)
        self.trained.append(batch["responses"].shape[0])
        self.events.append("update end")
        return [{"actor/pg_loss": 0.0}]


class Recorder:
    run_id = None

    def __init__(self) -> None:
        self.metrics: dict[int, dict] = {}

    def log(self, metrics, step) -> None:
        self.metrics.setdefault(step, {}).update(metrics)

    def log_table(self, *args) -> None: ...
    def finish(self) -> None: ...


def batches(k: int, first: int = 1):
    """Prompt batches b1, b2, ...: four prompts each, named `b<i>/<j>`."""
    return iter([SimpleNamespace(prompts=[f"b{i}/{j}" for j in range(4)], epoch=0) for i in range(first, first + k)])


def run(tmp_path, overrides, fail_at=None, loop_cls=SlowLoop):
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer, events = make_trainer(tmp_path, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=false",
                                              "trainer.total_training_steps=3", *overrides],
                                   colocated=False, loop_cls=loop_cls)
    trainer.workers.actor = SlowGroup("actor", events, fail_at)
    trainer.workers.ref = trainer.workers.critic = None
    trainer.tracker = Recorder()
    return trainer, events


def test_one_step_off_rolls_out_the_next_step_while_this_one_trains(tmp_path):
    """Contract: in one_step_off, step k+1's rollout starts before step k's update ends (the engines still hold the
    weights before it), the weight sync waits for that rollout, and every step after the first trains on tokens
    exactly one version behind the actor (staleness 1, none dropped); in sync nothing overlaps and staleness is 0."""
    trainer, events = run(tmp_path, ONE_STEP_OFF)
    trainer.fit(batches(3))
    assert [e for e in events if e.startswith(("rollout ", "update", "sync"))] == [
        "rollout start b1 v0", "rollout end b1",
        "rollout start b2 v0", "update start", "rollout end b2", "update end", "sync v1",
        "rollout start b3 v1", "update start", "rollout end b3", "update end", "sync v2",
        "update start", "update end", "sync v3"]
    m = trainer.tracker.metrics
    assert [m[k]["rollout/staleness/max"] for k in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [m[k]["rollout/staleness/dropped"] for k in (1, 2, 3)] == [0.0] * 3
    assert trainer.workers.actor.trained == [8, 8, 8]
    assert 0 < m[2]["perf/engine_busy_fraction"] <= 1 and m[2]["timing/wait_rollout_s"] >= 0

    trainer, events = run(tmp_path / "sync", [])
    trainer.fit(batches(3))
    assert [e for e in events if e.startswith(("rollout ", "update", "sync"))] == [
        e for k in (1, 2, 3) for e in (f"rollout start b{k} v{k - 1}", f"rollout end b{k}", "update start",
                                       "update end", f"sync v{k}")]
    assert [trainer.tracker.metrics[k]["rollout/staleness/max"] for k in (1, 2, 3)] == [0.0] * 3


class StaleLoop(SlowLoop):
    """One sample of every other prompt group stamped two weight versions behind the engines (a bug the bound must
    catch)."""

    async def generate(self, prompts, greedy=False, seed=None, over_sample_rate=0.0):
        trajs = await super().generate(prompts, greedy, seed, over_sample_rate)
        for t in trajs:
            if int(t.prompt_uid.split("/")[1]) % 2 or t.sample_index:
                continue
            for turn in t.turns:
                turn.weight_version = self.engine_version() - 2
        return trajs


@pytest.mark.parametrize("schedule", ["sync", "one_step_off"])
def test_no_token_older_than_the_bound_is_trained_on(tmp_path, schedule):
    """Contract: a prompt group with a trajectory sampled more versions behind the actor than the schedule's bound is
    dropped before the update and counted in rollout/staleness/dropped; the update sees only the other groups."""
    trainer, _ = run(tmp_path, ONE_STEP_OFF if schedule == "one_step_off" else [], loop_cls=StaleLoop)
    trainer.fit(batches(3))
    m = trainer.tracker.metrics
    # step 1: the stamps are at versions -2, older than any bound, in 2 of the 4 groups (4 of the 8 samples); later
    # steps likewise
    assert [m[k]["rollout/staleness/dropped"] for k in (1, 2, 3)] == [4.0] * 3
    assert [m[k]["rollout/staleness/max"] for k in (1, 2, 3)] == [2.0] + [3.0 if schedule == "one_step_off" else 2.0] * 2
    assert trainer.workers.actor.trained == [4, 4, 4]


def test_a_one_step_off_checkpoint_resumes_onto_the_rollout_done_ahead(tmp_path):
    """Contract: a one_step_off checkpoint keeps the next step's rollout (done ahead); a run that fails mid-update
    aborts the rollout then in flight, and resuming from the checkpoint trains step 2 on the saved rollout of b2
    (not rolled out again) and rolls out only b3, as the uninterrupted run did."""
    trainer, events = run(tmp_path, [*ONE_STEP_OFF, "trainer.save_freq=1"], fail_at=2)
    with pytest.raises(RuntimeError, match="rank died"):
        trainer.fit(batches(3))
    assert [e for e in events if e.startswith("rollout start")] == ["rollout start b1 v0", "rollout start b2 v0",
                                                                  "rollout start b3 v1"]
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("rollout-ahead"))
    trainer.close()

    resumed, events = run(tmp_path, [*ONE_STEP_OFF, "trainer.save_freq=1"])
    prompts = batches(3)
    resumed.resume(tmp_path / "out" / "global_step_1", prompts)
    resumed.fit(prompts)
    assert [e for e in events if e.startswith("rollout start")] == ["rollout start b3 v1"]
    assert resumed.workers.actor.trained == [8, 8]
    assert resumed.tracker.metrics[2]["rollout/staleness/max"] == 1.0  # b2 was sampled at v0, trained from v1
    resumed.close()


def test_one_step_off_needs_the_engines_on_their_own_pool(tmp_path):
    """Contract: one_step_off with hybrid placement (engines sharing the trainer's GPUs) is refused, naming the key."""
    with pytest.raises(ConfigError, match="actor_rollout_ref.hybrid_engine=false"):
        make_trainer(tmp_path, ["async_training.schedule=one_step_off"], colocated=False)
