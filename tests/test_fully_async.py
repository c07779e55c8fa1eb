"""fully_async and partial rollouts: weight updates that land while trajectories run.

Stand-ins at the engine seam only (`TokenEngine`: a scripted answer emitted token by token, an aborted request
returning what it emitted, as SGLang's does) and at the trainer's Megatron / weight-sync seams (recorders). The
router, the agent loop with its tool and interaction runners, the streaming rollouter and `Trainer.fit` on the
cpu_tiny preset's config are the real ones.
"""
from __future__ import annotations

import asyncio
import pickle
import random
import time
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import recipe.trainer as trainer_module
from recipe.config_schema import ConfigError, PPOConfig
from recipe.engine_faults import RunFailed
from recipe.schedules import FullyAsync
from recipe.trainer import Trainer, Workers
from rollout.engines.base import GenerateResult
from rollout.trajectory import FinishReason, Trajectory
from tests.test_agent_loop import AddTool, ScriptedUser, _call, _loop, _prompt
from tests.test_colocate import FakeGroup
from tests.test_schedules import Recorder

pytestmark = pytest.mark.unit

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "recipe" / "config")
FULLY_ASYNC = ["async_training.schedule=fully_async", "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1",
               "rollout.n_gpus_per_node=1"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class TokenEngine:
    """Emits the scripted answer of each turn (`policy(trajectory uid, turn)`) one token per `token_s` seconds, under
    its current weight version. An aborted request returns the tokens emitted so far with finish "abort"; a request
    for the same turn continues the answer where the last one stopped."""

    name = "token-engine"

    def __init__(self, tokenizer: Any, policy, token_s: float = 0.002) -> None:
        self.tokenizer, self.policy, self.token_s = tokenizer, policy, token_s
        self.version = 0
        self.num_inflight = 0
        self.emitted: dict[str, int] = {}  # "<uid>#<turn>" -> tokens of the answer emitted so far
        self._aborts: dict[str, asyncio.Event] = {}

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, input_ids, sampling_params, request_id) -> GenerateResult:
        if "#" not in request_id:  # the trainer's health probe
            return GenerateResult([0], [-0.1], "length", self.version)
        turn_key = request_id.split(".")[0]
        uid, turn = turn_key.rsplit("#", 1)
        answer = self.tokenizer.encode(self.policy(uid, int(turn)), add_special_tokens=False) + \
            [self.tokenizer.eos_token_id]
        start = self.emitted.get(turn_key, 0)
        abort = self._aborts[request_id] = asyncio.Event()
        self.num_inflight += 1
        out, finish = [], "stop"
        try:
            for tok in answer[start:start + sampling_params["max_new_tokens"]]:
                try:
                    await asyncio.wait_for(abort.wait(), self.token_s)
                    finish = "abort"
                    break
                except TimeoutError:
                    out.append(tok)
            else:
                finish = "stop" if start + len(out) == len(answer) else "length"
        finally:
            self.num_inflight -= 1
            del self._aborts[request_id]
        self.emitted[turn_key] = start + len(out) if finish == "abort" else 0  # a turn rolled out again starts over
        return GenerateResult(out, [-0.1] * len(out), finish, self.version)

    async def abort(self, request_id: str) -> None:
        if request_id in self._aborts:
            self._aborts[request_id].set()


def _long_answer(uid: str, turn: int) -> str:
    return "Let me think about it slowly and carefully. The answer is #### 4"


# ---- partial rollout, at the agent loop ---------------------------------------------------------


def test_a_partial_rollout_splits_a_turn_into_two_versions_where_the_update_landed(tokenizer):
    """Contract: a weight update landing mid-turn (router pause -> new version -> resume) leaves one assistant turn
    whose tokens before the pause carry the old version and those after it the new one; the turn's text is the whole
    answer, and nothing was sampled while paused."""
    engine = TokenEngine(tokenizer, _long_answer, token_s=0.01)
    loop = _loop(tokenizer, engine)

    async def run() -> tuple[list[Trajectory], int]:
        task = asyncio.ensure_future(loop.generate([_prompt("q")]))
        await asyncio.sleep(0.06)
        await loop.router.pause()
        cut = engine.emitted["q/0#0"]
        assert engine.num_inflight == 0 and 0 < cut
        engine.version = 1
        await asyncio.sleep(0.05)  # paused: nothing is sampled
        assert engine.emitted["q/0#0"] == cut
        loop.router.resume()
        return await task, cut

    (traj,), cut = asyncio.run(run())
    answer = tokenizer.encode(_long_answer("q/0", 0), add_special_tokens=False) + [tokenizer.eos_token_id]
    assert traj.finish_reason is FinishReason.STOP and traj.num_assistant_turns == 1
    assert traj.response_ids == answer and traj.response_mask == [1] * len(answer)
    assert [(s.role, s.start, s.end, s.weight_version) for s in traj.turns] == [("assistant", 0, len(answer), 0)]
    assert traj.weight_versions == [0, 1] and traj.turns[0].version_changes == [(cut, 1)]
    assert traj.messages[-1]["content"] == tokenizer.decode(answer[:-1])
    traj.check_invariants()
    assert Trajectory.from_dict(traj.to_dict()).turns == traj.turns


def test_tools_and_interactions_live_once_through_a_pause_mid_turn(tokenizer):
    """Contract: a pause that finds trajectories generating, waiting on a tool and waiting on the simulated user
    keeps each in place: every one finishes, and each tool instance is created and released, each interaction
    started and finalized, exactly once."""
    policy = lambda uid, turn: {"tool": [_call("add", a=2, b=3), "It is #### 5"],  # noqa: E731
                                "user": ["I think #### 5", "Sure, #### 5"]}[uid.split("-")[0]][turn]
    engine = TokenEngine(tokenizer, policy, token_s=0.005)
    tool, user = AddTool(delay_s=0.15), ScriptedUser({"name": "user"})
    loop = _loop(tokenizer, engine, [tool], [user], n=2)
    prompts = [_prompt("tool-a", tools_kwargs={"add": {}}),
               _prompt("user-b", interaction_kwargs={"name": "user", "answer": "5"})]

    at_pause: list[tuple[int, int]] = []  # (requests in flight, tool calls running) when each pause began

    async def run() -> list[Trajectory]:
        task = asyncio.ensure_future(loop.generate(prompts))
        for _ in range(6):
            await asyncio.sleep(0.04)
            at_pause.append((len(loop.router._requests), tool.active))
            await loop.router.pause()
            engine.version += 1
            await asyncio.sleep(0.03)
            loop.router.resume()
        return await task

    out = asyncio.run(run())
    assert [t.finish_reason for t in out] == [FinishReason.STOP] * 4
    assert any(len(set(t.weight_versions)) > 1 for t in out)  # some turn crossed an update
    assert any(n for n, _ in at_pause) and any(k for _, k in at_pause)  # paused mid-generation and mid-call
    assert sorted(tool.created) == sorted(tool.released) and len(tool.created) == 4  # every sample may call it
    assert sorted(user.started) == sorted(user.finalized) and len(user.started) == 2
    assert loop.instance_metrics() == {"rollout/tool/add/instances_live": 0.0,
                                       "rollout/interaction/user/instances_live": 0.0}
    for t in out:
        t.check_invariants()


# ---- fully_async, at the trainer --------------------------------------------------------------


class VersionSync:
    """Stand-in WeightSync: sets the engine's version; records, per sync, whether a request was in flight."""

    def __init__(self, engine: TokenEngine, router) -> None:
        self.engine, self.router = engine, router
        self.synced: list[tuple[int, int]] = []  # (version, requests in flight at the sync)

    def sync(self, version: int, check: bool | None = None) -> dict[str, float]:
        self.synced.append((version, len(self.router._requests)))
        self.engine.version = version
        return {}

    def forget_groups(self, engines) -> None: ...
    def close(self) -> None: ...


class SlowGroup(FakeGroup):
    """An update that takes `update_s`."""

    update_s = 0.05

    def dispatch(self, method, batch, mini_batches=None, **kwargs):
        if method == "update_policy":
            time.sleep(self.update_s)
        return super().dispatch(method, batch, mini_batches, **kwargs)


class LongTailTool(AddTool):
    """`add`, taking 10 ms, or 1.2 s for one call in six (seeded): a long tail across several weight updates."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(1.2 if self.rng.random() < 1 / 6 else 0.01)
        return await super().execute(instance_id, parameters, **kwargs)


def _answer(uid: str, turn: int) -> str:
    return [_call("add", a=2, b=2), "So it is #### 4"][turn]


def _batches(k: int):
    from recipe.data.dataset import PromptBatch

    for i in range(k):
        yield PromptBatch([_prompt(f"b{i}/{j}", tools_kwargs={"add": {}}, data_source="openai/gsm8k",
                                   ground_truth="4") for j in range(4)], epoch=0)


def _fully_async_trainer(tokenizer, tmp_path, overrides: list[str], tool: AddTool) -> tuple[Trainer, VersionSync]:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="cpu_tiny", overrides=[
            f"data.train_files=[{__file__}]", f"trainer.default_local_dir={tmp_path / 'out'}",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=false", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2", "trainer.save_freq=-1",
            "trainer.test_freq=-1", *FULLY_ASYNC, *overrides])
    cfg = PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    engine = TokenEngine(tokenizer, _answer, token_s=0.002)
    loop = _loop(tokenizer, engine, [tool], n=2, response_length=128)
    sync = VersionSync(engine, loop.router)
    events: list[str] = []
    workers = Workers(actor=SlowGroup("actor", events), ref=None, critic=None, engines=[], weight_sync=sync,
                      colocated=False)
    return Trainer(cfg, workers, loop, Recorder()), sync


def _record_trained(monkeypatch, trainer: Trainer) -> list[tuple[int, list[Trajectory]]]:
    """(the actor's version, the trajectories) of every batch the trainer collates for an update."""
    seen: list[tuple[int, list[Trajectory]]] = []
    collate = trainer_module.collate

    def recording(trajs, pad):
        seen.append((trainer.weight_version + trainer.unsynced_updates, list(trajs)))
        return collate(trajs, pad)

    monkeypatch.setattr(trainer_module, "collate", recording)
    return seen


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_fully_async_trains_no_token_older_than_the_bound_under_a_long_tail_of_tools(tokenizer, tmp_path,
                                                                                     monkeypatch, policy):
    """Contract: with tool calls that outlast several weight updates, fully_async trains every step on
    train_batch_size groups, and no trained token was sampled more than the bound's versions behind the actor; the
    groups past it are dropped (or rolled out again) and counted; the updates landed with no request in flight
    (partial rollout), and some trained turns carry two versions."""
    trainer, sync = _fully_async_trainer(tokenizer, tmp_path, ["trainer.total_training_steps=10",
                                                               "async_training.staleness_bound=1",
                                                               f"async_training.stale_policy={policy}"],
                                         LongTailTool())
    seen = _record_trained(monkeypatch, trainer)
    trainer.fit(_batches(100))
    trainer.close()
    assert len(seen) == 10 and all(len(trajs) == 8 for _, trajs in seen)
    for actor_version, trajs in seen:
        oldest = min(v for t in trajs for v in t.weight_versions)
        assert actor_version - oldest <= 1
    m = trainer.tracker.metrics
    past = sum(m[k][f"rollout/staleness/{'dropped' if policy == 'drop' else 'regenerated'}_groups"] for k in m)
    assert past > 0  # the workload does break the bound
    assert max(m[k]["rollout/staleness/max"] for k in m) <= 1
    assert [v for v, _ in sync.synced] == list(range(1, 11)) and all(n == 0 for _, n in sync.synced)
    assert any(t.turns[0].version_changes for _, trajs in seen for t in trajs)
    assert all(0 <= m[k]["perf/engine_busy_fraction"] <= 1 and 0 <= m[k]["perf/trainer_busy_fraction"] <= 1
               for k in m)


def test_fully_async_without_partial_rollouts_syncs_between_groups(tokenizer, tmp_path, monkeypatch):
    """Contract: with partial_rollout=false no turn is split: each sync waits for the groups started, so every
    trajectory's tokens carry one version; every trigger_parameter_sync_step steps."""
    trainer, sync = _fully_async_trainer(tokenizer, tmp_path, ["trainer.total_training_steps=4",
                                                               "async_training.partial_rollout=false",
                                                               "async_training.trigger_parameter_sync_step=2"],
                                         AddTool(delay_s=0.02))
    seen = _record_trained(monkeypatch, trainer)
    trainer.fit(_batches(100))
    trainer.close()
    assert [v for v, _ in sync.synced] == [2, 4] and all(n == 0 for _, n in sync.synced)
    assert all(len(set(t.weight_versions)) == 1 for _, trajs in seen for t in trajs)
    assert [v for v, _ in seen] == [0, 1, 2, 3]  # the actor's updates, counted between syncs


def test_a_fully_async_checkpoint_keeps_finished_groups_and_rolls_out_the_rest_first(tokenizer, tmp_path,
                                                                                     monkeypatch):
    """Contract: a fully_async checkpoint saves the finished groups not yet trained and the prompts in flight or
    drawn and not started; the resumed run trains on those groups first and rolls those prompts out before any new
    one, so no prompt drawn before the checkpoint is lost."""
    trainer, _ = _fully_async_trainer(tokenizer, tmp_path, ["trainer.total_training_steps=2", "trainer.save_freq=2",
                                                            "async_training.staleness_threshold=1.0"],
                                      AddTool(delay_s=0.02))
    trainer.workers.actor.call_all = lambda method, *a, **k: Path(a[0]).mkdir(parents=True) if a else None
    trainer.fit(_batches(100))
    trainer.close()
    saved = tmp_path / "out" / "global_step_2"
    finished, pending = pickle.loads((saved / FullyAsync.FILE).read_bytes())
    assert len(finished) + len(pending) >= 4  # capacity 8 groups: 4 taken by step 2, the others saved

    resumed, _ = _fully_async_trainer(tokenizer, tmp_path, ["trainer.total_training_steps=3"], AddTool(delay_s=0.02))
    resumed.workers.actor.call_all = lambda *a, **k: None
    started: list[str] = []
    generate = resumed.agent_loop.generate

    async def recording(prompts, **kw):
        started.extend(p.uid for p in prompts)
        return await generate(prompts, **kw)

    resumed.agent_loop.generate = recording
    seen = _record_trained(monkeypatch, resumed)
    batches = _batches(100)
    resumed.resume(saved, batches)
    resumed.fit(batches)
    resumed.close()
    assert started[: len(pending)] == [p.uid for p in pending]
    first = {t.prompt_uid for t in seen[0][1]}
    assert {p.uid for p, _ in finished[:4]} <= first and resumed.global_step == 3


def _mixed(uid: str, turn: int) -> str:
    """Groups of even prompts: sample 0 right, the others wrong; groups of odd prompts: all wrong (no signal)."""
    prompt, sample = uid.rsplit("/", 1)
    right = int(prompt.split("/")[1]) % 2 == 0 and sample == "0"
    return [_call("add", a=2, b=2), "So it is #### " + ("4" if right else "5")][turn]


def test_fully_async_dynamic_sampling_keeps_groups_with_a_signal_as_they_finish(tokenizer, tmp_path, monkeypatch):
    """Contract: with algorithm.filter_groups on, each fully_async step trains on exactly train_batch_size groups
    whose scores differ, taking finished groups until it has them; a limit reached short of the batch stops the
    run naming the key."""
    overrides = ["trainer.total_training_steps=3", "algorithm.filter_groups.enable=true",
                 "algorithm.filter_groups.metric=score"]
    trainer, _ = _fully_async_trainer(tokenizer, tmp_path, overrides, AddTool())
    trainer.agent_loop.router.engines[0].policy = _mixed
    seen = _record_trained(monkeypatch, trainer)
    trainer.fit(_batches(100))
    trainer.close()
    assert [len({t.prompt_uid for t in trajs}) for _, trajs in seen] == [4, 4, 4]
    assert all(int(t.prompt_uid.split("/")[1]) % 2 == 0 for _, trajs in seen for t in trajs)
    assert all(m["rollout/filter_groups/dropped_groups"] >= 1 for m in trainer.tracker.metrics.values())

    trainer, _ = _fully_async_trainer(tokenizer, tmp_path, [*overrides, "algorithm.filter_groups.max_num_gen_batches=1"],
                                      AddTool())
    trainer.agent_loop.router.engines[0].policy = _mixed
    with pytest.raises(RunFailed, match=r"dynamic sampling kept 2 of data.train_batch_size=4 groups "
                                                       r".*max_num_gen_batches=1"):
        trainer.fit(_batches(100))
    trainer.close()


def test_a_prompt_the_loop_refuses_stops_a_fully_async_run(tokenizer, tmp_path):
    """Contract: a prompt group that cannot be rolled out (its row names a tool that is not registered) stops the
    run with one line naming the cause, instead of a trainer waiting for a group that never comes."""
    from recipe.data.dataset import PromptBatch

    trainer, _ = _fully_async_trainer(tokenizer, tmp_path, ["trainer.total_training_steps=2"], AddTool())
    bad = iter([PromptBatch([_prompt(f"b0/{j}", tools_kwargs={"nope": {}}) for j in range(4)], epoch=0)] * 3)
    with pytest.raises(RunFailed, match=r"step 1: the rollouter stopped: .*nope"):
        trainer.fit(bad)
    trainer.close()


def test_fully_async_refusals(tmp_path):
    """Contract: fully_async needs the engines on their own pool; stale_policy=regenerate and a staleness_bound
    need fully_async."""
    base = [f"data.train_files=[{__file__}]"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        for overrides, words in ((["async_training.schedule=fully_async"], "hybrid_engine=false"),
                                 (["async_training.stale_policy=regenerate"], "needs async_training.schedule=fully_async"),
                                 (["async_training.staleness_bound=2"], "staleness_bound is fixed")):
            cfg = compose(config_name="cpu_tiny", overrides=[*base, *overrides])
            with pytest.raises(ConfigError, match=words):
                PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
