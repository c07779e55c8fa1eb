"""Faults, unit level: engines that die or hang, steps whose trajectories mostly failed.

Stand-ins at the engine seam only (`tests.test_agent_loop.ScriptedEngine`, plus a death, a hang
and a `restart`), and at the trainer's Megatron / weight-sync seams (recorders that refuse any
training call). Everything else is real: the router, the agent loop with its tool and interaction
runners, and `recipe.trainer.Trainer.step` on the cpu_tiny preset's config. The same behaviour on
real SGLang engines, Megatron ranks and `python -m recipe.main_ppo` processes is in
tests/test_faults_e2e.py.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.config_schema import PPOConfig
from recipe.data.dataset import PromptBatch
from recipe.engine_faults import RunFailed
from recipe.trainer import Trainer, Workers
from rollout.engines.base import EngineDeadError, GenerateResult
from rollout.trajectory import FinishReason
from tests.test_agent_loop import (
    AddTool,
    ScriptedEngine,
    ScriptedUser,
    _call,
    _loop,
    _prompt,
)

pytestmark = pytest.mark.unit

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "recipe" / "config")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class FaultyEngine(ScriptedEngine):
    """A scripted engine whose actor "dies" on its `die_at`-th request (EngineDeadError from then on, until
    `restart`), or that never answers a health probe once `hang_probes` is set; answers probes otherwise."""

    def __init__(self, tokenizer: Any, policy, name: str, die_at: int | None = None):
        super().__init__(tokenizer, policy, name=name)
        self.die_at, self.dead, self.hang_probes, self.restarts, self.requests = die_at, False, False, 0, 0

    async def generate(self, input_ids, sampling_params, request_id) -> GenerateResult:
        if request_id.startswith("health-"):
            if self.dead:
                raise EngineDeadError(self.name, "its actor died (ActorDiedError)")
            if self.hang_probes:
                await asyncio.sleep(3600)
            return GenerateResult([1], [0.0], "length", self.version)
        self.requests += 1
        if self.dead or self.requests == self.die_at:
            self.dead = True
            raise EngineDeadError(self.name, f"its actor died during request {request_id} (ActorDiedError)")
        return await super().generate(input_ids, sampling_params, request_id)

    def restart(self) -> None:
        self.dead, self.die_at, self.requests, self.restarts = False, None, 0, self.restarts + 1


def _answer(uid: str, turn: int) -> str:
    return [_call("add", a=2, b=3), "The answer is #### 5"][turn]


def test_trajectories_of_a_dead_engine_are_retried_on_a_live_one_with_fresh_tools_and_interactions(tokenizer):
    """Contract: a trajectory whose engine dies mid-conversation starts over on an engine still alive: its tool
    instances released and its interaction finalized once for the failed attempt, then created anew; the new
    attempt's tokens are the live engine's only; each retry counted; the dead engine gets no further request."""
    dying = FaultyEngine(tokenizer, _answer, "engine0", die_at=2)  # q/0's first turn, then dies in its second
    live = ScriptedEngine(tokenizer, _answer, name="engine1")
    tool, user = AddTool(), ScriptedUser({"name": "user"})
    loop = _loop(tokenizer, [dying, live], [tool], [user], n=2)
    deaths: list[tuple[int, str]] = []
    loop.router.on_dead = lambda idx, err: deaths.append((idx, err.engine))
    prompt = _prompt("q", tools_kwargs={"add": {}}, interaction_kwargs={"name": "user", "answer": "5"})
    out = asyncio.run(loop.generate([prompt]))
    assert [t.finish_reason for t in out] == [FinishReason.STOP] * 2
    assert deaths == [(0, "engine0")] and loop.router.dead.keys() == {0}
    assert loop.retried == 1 and dying.requests == 2 and len(dying.returned["q/0"]) == 1
    assert len(tool.created) == len(tool.released) == 3  # 2 trajectories + 1 failed attempt, each released once
    assert sorted(user.started) == sorted(user.finalized) and len(user.started) == 3
    for t in out:  # every token trained on came from the live engine
        assert t.response_ids[: len(live.returned[t.uid][0])] == live.returned[t.uid][0]
        assert len(live.returned[t.uid]) == t.num_assistant_turns == 2
    assert loop.instance_metrics()["rollout/tool/add/instances_live"] == 0


def test_retries_are_bounded_and_need_a_live_engine(tokenizer):
    """Contract: past max_trajectory_retries, or with every engine dead, the trajectory ends in error naming the
    engine and the key; a rollout on dead engines ends at once instead of waiting."""
    a = FaultyEngine(tokenizer, _answer, "engine0", die_at=1)
    b = FaultyEngine(tokenizer, _answer, "engine1", die_at=1)
    loop = _loop(tokenizer, [a, b], [AddTool()], n=2, max_trajectory_retries=0)
    out = asyncio.run(loop.generate([_prompt("q", tools_kwargs={"add": {}})]))
    assert [t.finish_reason for t in out] == [FinishReason.ERROR] * 2 and loop.retried == 0
    assert {t.error.split(":")[0] for t in out} == {"engine engine0", "engine engine1"}
    assert all("max_trajectory_retries" in t.error for t in out)
    loop = _loop(tokenizer, [FaultyEngine(tokenizer, _answer, "engine0", die_at=1)], [AddTool()], n=3)
    out = asyncio.run(loop.generate([_prompt("q", tools_kwargs={"add": {}})]))
    assert [t.finish_reason for t in out] == [FinishReason.ERROR] * 3 and loop.retried == 0


# ---- the trainer -------------------------------------------------------------------------------


class Trained(Exception):
    """Raised by the stand-in Megatron group: the step went on to train."""


class NoTraining:
    """Stand-in Megatron group: any call means the step trains."""

    def call_all(self, method: str, *args: Any, **kwargs: Any):
        raise Trained(method)

    def dispatch(self, method: str, *args: Any, **kwargs: Any):
        raise Trained(method)


class SyncRecorder:
    """Stand-in WeightSync: records what the trainer asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def forget_groups(self, restarted) -> None:
        self.calls.append(("forget_groups", [e.name for e in restarted]))

    def sync(self, version: int, *, check: bool | None = None) -> dict[str, float]:
        self.calls.append(("sync", version, check))
        return {}


class Tracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.run_id = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))

    def log_table(self, *args: Any, **kwargs: Any) -> None:
        pass


def _trainer(tokenizer, engines, **overrides: Any) -> tuple[Trainer, SyncRecorder, Tracker]:
    keys = [f"{k}={v}" for k, v in overrides.items()]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="cpu_tiny", overrides=[f"data.train_files=[{__file__}]", *keys])
    cfg = PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    loop = _loop(tokenizer, engines, [AddTool()], n=2, response_length=64,
                 engine_health_timeout_s=cfg.actor_rollout_ref.rollout.engine_health_timeout_s)
    sync, tracker = SyncRecorder(), Tracker()
    workers = Workers(actor=NoTraining(), ref=None, critic=None, engines=list(engines), weight_sync=sync,
                      colocated=False)
    return Trainer(cfg, workers, loop, tracker), sync, tracker


def _batch() -> PromptBatch:
    return PromptBatch([_prompt(f"q{i}", tools_kwargs={"add": {}}, data_source="openai/gsm8k", ground_truth="5")
                        for i in range(4)], epoch=0)


def test_mostly_failed_steps_are_not_trained_on_and_max_failed_steps_in_a_row_stop_the_run(tokenizer, tmp_path):
    """Contract (fail closed): a step where more than trainer.max_failed_fraction of the trajectories ended in error
    trains nothing (logged with fault/* metrics); trainer.max_failed_steps such steps in a row raise RunFailed
    naming the key and the first error; a step at or under the fraction trains and resets the count."""
    failing = {f"q{i}/{k}" for i in range(3) for k in range(2)}  # 6 of 8 trajectories: 75% in error
    engine = FaultyEngine(tokenizer, _answer, "engine0")
    engine.fail_on = failing
    trainer, _, tracker = _trainer(tokenizer, [engine], **{"trainer.default_local_dir": tmp_path})
    for step in (1, 2):
        metrics = trainer.step(step, _batch)
        assert metrics["fault/failed_fraction"] == 0.75 and metrics["fault/skipped_steps"] == step
    assert [s for s, _ in tracker.logged] == [1, 2]
    engine.fail_on = {"q0/0", "q0/1", "q1/0", "q1/1"}  # 50%: not more than the fraction, trained on
    with pytest.raises(Trained):
        trainer.step(3, _batch)
    assert trainer.faults.failed_steps_in_row == 0
    engine.fail_on = failing
    trainer.step(4, _batch)
    trainer.step(5, _batch)
    with pytest.raises(RunFailed, match=r"3 steps in a row trained nothing \(step 6: 75% of its trajectories ended "
                                        r"in error .*first error: RuntimeError: engine failure.*"
                                        r"trainer.max_failed_steps=3\)"):
        trainer.step(6, _batch)


def test_a_dead_engine_is_restarted_synced_and_checked_until_its_restarts_run_out(tokenizer, tmp_path):
    """Contract (engine faults): an engine whose actor dies in a rollout is restarted after it, synced to the
    current weight version with the checksum check, and routed to again; the step trains on the trajectories
    retried elsewhere; restarts and retries are counted. An engine that then misses a health probe with no restart
    left stops the run with RunFailed naming the engine, what happened and the key."""
    dying = FaultyEngine(tokenizer, _answer, "engine0", die_at=1)
    live = FaultyEngine(tokenizer, _answer, "engine1")
    trainer, sync, _ = _trainer(tokenizer, [dying, live], **{
        "trainer.default_local_dir": tmp_path, "actor_rollout_ref.rollout.max_engine_restarts": 1,
        "actor_rollout_ref.rollout.engine_health_timeout_s": 0.5})
    trainer.weight_version = 4
    with pytest.raises(Trained):  # the step trains: every trajectory was retried on engine1
        trainer.step(1, _batch)
    assert dying.restarts == 1 and not trainer.agent_loop.router.dead
    assert sync.calls == [("forget_groups", ["engine0"]), ("sync", 4, True)]
    assert trainer.faults.metrics() == {"fault/engine_restarts": 1.0, "fault/retried_trajectories": 1.0,
                              "fault/skipped_steps": 0.0}
    dying.hang_probes = True
    with pytest.raises(RunFailed, match=r"^engine engine0: no answer to a health probe within 0.5 s "
                                        r".*all 1 restarts used \(actor_rollout_ref.rollout.max_engine_restarts=1\)"):
        trainer.step(2, _batch)
    assert dying.restarts == 1


class DyingSync(SyncRecorder):
    """A weight sync during which `engine` dies (its first sync raises, as Ray's ActorDiedError would)."""

    def __init__(self, engine: FaultyEngine, fail: bool = True) -> None:
        super().__init__()
        self.engine, self.fail = engine, fail

    def sync(self, version: int, *, check: bool | None = None) -> dict[str, float]:
        super().sync(version, check=check)
        if self.fail:
            self.fail, self.engine.dead = False, True
            raise RuntimeError(f"ActorDiedError: the actor of {self.engine.name} died")
        return {"weight_sync/seconds": 0.0}


def test_an_engine_dead_at_the_weight_sync_is_restarted_and_every_engine_synced_again(tokenizer, tmp_path):
    """Contract (issue 17): an engine that dies outside a rollout, during the weight sync, is found by a probe,
    restarted and the sync redone on every engine with the checksum check, under the new version; a sync that fails
    with every engine alive is raised; with no restart left the run stops naming the engine and the key."""
    dying, live = FaultyEngine(tokenizer, _answer, "engine0"), FaultyEngine(tokenizer, _answer, "engine1")
    trainer, _, _ = _trainer(tokenizer, [dying, live], **{
        "trainer.default_local_dir": tmp_path, "actor_rollout_ref.rollout.max_engine_restarts": 1})
    sync = trainer.workers.weight_sync = DyingSync(dying)
    trainer.unsynced_updates = 1
    metrics = trainer.sync_weights()
    assert sync.calls == [("sync", 1, None), ("forget_groups", ["engine0"]), ("sync", 1, True)]
    assert dying.restarts == 1 and trainer.weight_version == 1 and not trainer.agent_loop.router.dead
    assert metrics == {"weight_sync/seconds": 0.0} and trainer.faults.metrics()["fault/engine_restarts"] == 1
    sync.fail, sync.engine = True, FaultyEngine(tokenizer, _answer, "bystander")  # fails, every engine alive
    trainer.unsynced_updates = 1
    with pytest.raises(RuntimeError, match="ActorDiedError: the actor of bystander"):
        trainer.sync_weights()
    assert trainer.weight_version == 1
    sync.fail, sync.engine = True, dying  # dies again: its one restart is used
    with pytest.raises(RunFailed, match=r"engine engine0: .*all 1 restarts used \(actor_rollout_ref.rollout."
                                        r"max_engine_restarts=1\)"):
        trainer.sync_weights()
    assert dying.restarts == 1


def test_with_no_restart_allowed_a_dead_engine_stops_the_rollout_at_once(tokenizer, tmp_path):
    """Contract: with max_engine_restarts=0 the first engine death aborts the rollout (a trajectory that would
    never end on the live engine is not waited for) and stops the run naming the engine; nothing trains."""
    dying = FaultyEngine(tokenizer, _answer, "engine0", die_at=1)
    hanging = FaultyEngine(tokenizer, lambda uid, turn: None, "engine1")  # never answers until aborted
    trainer, sync, _ = _trainer(tokenizer, [dying, hanging], **{
        "trainer.default_local_dir": tmp_path, "actor_rollout_ref.rollout.max_engine_restarts": 0})
    with pytest.raises(RunFailed, match=r"^engine engine0: its actor died during request .*; restarts are off "
                                        r"\(actor_rollout_ref.rollout.max_engine_restarts=0\): stopping the run$"):
        trainer.step(1, _batch)
    assert dying.restarts == 0 and sync.calls == [] and hanging.aborted
