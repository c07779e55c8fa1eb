"""Colocated memory choreography: the order in which engines and Megatron ranks take turns on the GPUs.

On a CPU machine SGLang's `release_memory_occupation` is a no-op, so the order is checked here
with recorders standing in for the worker groups, the engines and the weight sync around the
real `Trainer.step`; on GPUs the same calls run.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.config_schema import PPOConfig
from recipe.trainer import Trainer, Workers
from rollout.trajectory import FinishReason, Trajectory

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "recipe" / "config")
OFFLOAD = ["actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
           "actor_rollout_ref.actor.megatron.optimizer_offload=true"]


class FakeGroup:
    """Records the calls a Megatron worker group receives; answers with zeros of the right shapes."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events
        self.batches: dict[str, dict] = {}  # the last batch of each method

    def dispatch(self, method: str, batch: dict, mini_batches: int | None = None, **kwargs) -> list[dict]:
        self.events.append(f"{self.name}.{method}")
        self.batches[method] = batch
        shape = batch["responses"].shape
        if method in ("compute_log_prob", "compute_values"):
            return [{"log_probs": torch.zeros(shape), "values": torch.zeros(shape)}]
        return [{f"{self.name}/loss": 0.0}]

    def call_all(self, method: str, *args, **kwargs) -> list[None]:
        self.events.append(f"{self.name}.{method}")
        return [None]

    def shutdown(self) -> None:
        self.events.append(f"{self.name}.shutdown")


class FakeEngine:
    """Records memory and lifecycle calls of an engine client."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    def release_memory_occupation(self, tags=None) -> None:
        self.events.append(f"{self.name}.release{tags or ''}")

    def resume_memory_occupation(self, tags=None) -> None:
        self.events.append(f"{self.name}.resume{tags or ''}")

    def restart(self) -> None:
        self.events.append(f"{self.name}.restart")

    def shutdown(self) -> None:
        self.events.append(f"{self.name}.shutdown")


class FakeSync:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.version = 0  # the engines' weight version

    def sync(self, version: int, check: bool = False) -> dict[str, float]:
        self.events.append(f"sync v{version}")
        self.version = version
        return {"weight_sync/seconds": 0.0}

    def forget_groups(self, engines) -> None: ...

    def close(self) -> None:
        self.events.append("sync.close")


class FakeTokenizer:
    """Decodes ids as `<id>` text, for the trajectory dumps (cpu_tiny sets trainer.rollout_data_dir)."""

    name_or_path = "fake/tokenizer"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakeAgentLoop:
    """Returns `n` sampled trajectories per prompt, each answering '#### 4', sampled by the engines' weight version
    (`engine_version()`)."""

    pad_token_id = 0
    codec = SimpleNamespace(tokenizer=FakeTokenizer())

    def __init__(self, events: list[str], n: int) -> None:
        self.events, self.n = events, n
        self.seeds: list[int | None] = []  # each generate call's seed
        self.tools = SimpleNamespace(aclose=self._noop)
        self.retried = 0  # no engine faults here (tests/test_faults.py has them)
        self.router = SimpleNamespace(engines=[], dead={}, on_dead=None, probe=self._probe, busy_seconds=lambda: self.busy_s)
        self.busy_s = 0.0  # seconds "generating" so far (the router's busy_seconds)
        self.engine_version: Callable[[], int] = lambda: 0  # make_trainer: the FakeSync's version

    async def _noop(self) -> None:
        return None

    async def _probe(self, timeout_s: float) -> None:
        return None

    async def generate(self, prompts, greedy: bool = False, seed: int | None = None,
                       over_sample_rate: float = 0.0, progress: bool = True) -> list[Trajectory]:
        self.events.append("rollout")
        self.seeds.append(seed)
        trajs = []
        for p in prompts:
            for j in range(self.n):
                t = Trajectory(uid=f"{p}/{j}", prompt_uid=p, sample_index=j, prompt_ids=[1, 2, 3],
                               data_source="openai/gsm8k", ground_truth="4")
                t.append_assistant([5, 6, 7 + j], [-0.5, -0.5, -0.5], self.engine_version())
                t.messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "#### 4"}]
                t.finish(FinishReason.STOP)
                trajs.append(t)
        return trajs

    async def abort(self) -> None:
        return None

    def instance_metrics(self) -> dict[str, float]:
        return {}


class FakeTracker:
    def log(self, metrics, step) -> None: ...
    def log_table(self, *args) -> None: ...
    def finish(self) -> None: ...


def make_trainer(tmp_path: Path, overrides: list[str], colocated: bool,
                 loop_cls: type[FakeAgentLoop] = FakeAgentLoop) -> tuple[Trainer, list[str]]:
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")  # validation only checks that the file exists
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="cpu_tiny", overrides=[
            f"data.train_files=[{data}]", f"trainer.default_local_dir={tmp_path / 'out'}",
            "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_kl_loss=true",
            *overrides])
    config = PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    events: list[str] = []
    workers = Workers(actor=FakeGroup("actor", events), ref=FakeGroup("ref", events), critic=FakeGroup("critic", events),
                      engines=[FakeEngine("engine0", events), FakeEngine("engine1", events)],
                      weight_sync=FakeSync(events), colocated=colocated)
    loop = loop_cls(events, config.actor_rollout_ref.rollout.n)
    loop.engine_version = lambda: workers.weight_sync.version
    return Trainer(config, workers, loop, FakeTracker()), events


def prompts(k: int = 4) -> SimpleNamespace:
    return SimpleNamespace(prompts=[f"p{i}" for i in range(k)], epoch=0)


def phases(events: list[str]) -> list[str]:
    """Collapse consecutive calls of the same kind on several workers into one phase."""
    out: list[str] = []
    for e in events:
        kind = e.split(".", 1)[-1] if e.startswith(("actor.", "ref.", "critic.", "engine")) else e
        kind = {"compute_log_prob": "train", "compute_values": "train", "update_critic": "train",
                "update_policy": "train"}.get(kind, kind)
        if not out or out[-1] != kind:
            out.append(kind)
    return out


@pytest.mark.unit
def test_colocated_step_takes_turns_on_the_gpus_in_order(tmp_path):
    """Contract (hybrid placement, offload on): every step runs rollout -> engines release memory ->
    Megatron onload -> train -> offload -> engines resume weights -> sync -> engines resume KV cache,
    on every engine and every Megatron role (the workers arrive offloaded: next test)."""
    trainer, events = make_trainer(tmp_path, OFFLOAD, colocated=True)
    assert events == []
    trainer.step(1, prompts)
    trainer.step(2, prompts)
    step = ["rollout", "release", "onload", "train", "offload", "resume['weights']", "sync v{}",
            "resume['kv_cache', 'cuda_graph']"]
    assert phases(events) == [p.format(1) for p in step] + [p.format(2) for p in step]
    release_then_onload = events[1:6]
    assert release_then_onload == ["engine0.release", "engine1.release", "actor.onload", "ref.onload", "critic.onload"]
    assert trainer.weight_version == 2
    trainer.close()


@pytest.mark.unit
def test_colocated_engines_get_their_weights_back_in_critic_warmup_steps(tmp_path):
    """Contract: colocated engines released their weights for training (SGLang keeps no copy), so a step that does
    not update the actor (trainer.critic_warmup) still syncs the unchanged weights into them before they serve."""
    trainer, events = make_trainer(tmp_path, OFFLOAD + ["trainer.critic_warmup=2"], colocated=True)
    trainer.step(1, prompts)
    assert "actor.update_policy" not in events and "critic.update_critic" in events
    assert phases(events)[-3:] == ["resume['weights']", "sync v0", "resume['kv_cache', 'cuda_graph']"]
    trainer.close()


@pytest.mark.unit
def test_a_sync_that_finds_an_engine_dead_probes_with_the_kv_cache_back_and_restarts_only_that_one(tmp_path):
    """Contract: when the sync fails with an engine dead, the colocated engines get their KV cache back before the
    health probe (which generates a token: into released KV memory it would fail on every engine, restarting them
    all); only the dead engine is restarted, holding all its memory like the others, then every engine is synced,
    and the step's last resume has nothing left to resume."""
    trainer, events = make_trainer(tmp_path, OFFLOAD, colocated=True)
    sync, router = trainer.workers.weight_sync, trainer.agent_loop.router
    first = {"failed": False}

    def failing_sync(version: int, check: bool = False) -> dict[str, float]:
        if not first["failed"]:
            first["failed"] = True
            router.dead = {1: "engine1 died"}
            events.append("sync failed")
            raise RuntimeError("engine1 died mid-sync")
        events.append(f"sync v{version}")
        return {"weight_sync/seconds": 0.0}

    async def probe(timeout_s: float) -> None:
        events.append(f"probe, released: {sorted(trainer.handover.released)}")

    sync.sync = failing_sync
    router.engines, router.probe = trainer.workers.engines, probe
    router.revive = lambda idx: router.dead.pop(idx)
    trainer.faults.restarts = [0, 0]
    trainer.step(1, prompts)
    tail = events[events.index("sync failed") + 1:]
    assert sorted(tail[:2]) == ["engine0.resume['kv_cache', 'cuda_graph']", "engine1.resume['kv_cache', 'cuda_graph']"]
    assert tail[2:] == ["probe, released: []", "engine1.restart", "sync v1"]
    assert trainer.faults.restarts == [0, 1]
    trainer.close()


@pytest.mark.unit
def test_engines_release_and_resume_their_memory_at_once(tmp_path):
    """Contract: every engine's release / resume (each a device synchronize and a remap of tens of GB on a GPU) runs
    at the same time as the others', not engine after engine: here each call waits for the other engine's."""
    trainer, events = make_trainer(tmp_path, OFFLOAD, colocated=True)
    barrier = threading.Barrier(len(trainer.workers.engines), timeout=10)
    for engine in trainer.workers.engines:
        for method in ("release_memory_occupation", "resume_memory_occupation"):
            def together(tags=None, _call=getattr(engine, method)) -> None:
                barrier.wait()  # BrokenBarrierError after 10 s when the engines are called one after another
                _call(tags)
            setattr(engine, method, together)
    trainer.step(1, prompts)
    assert sum(e.startswith(("engine0.release", "engine0.resume")) for e in events) == 3
    trainer.close()


def build_with_recorders(tmp_path, monkeypatch, use_gpus: bool, events: list[str], on_build=None, on_launch=None):
    """`main_ppo.build_workers` on the hybrid 2-GPU plan with recorders for the groups, the placement, the engines'
    launch and the weight sync; `on_build(role)` / `on_launch(name)` run inside each group build / engine launch."""
    import transformers

    import megatron_workers.worker_group as worker_group
    import recipe.main_ppo as main_ppo
    import recipe.weight_sync as weight_sync
    import rollout.engines.engine_actor as engine_actor
    from recipe.placement import plan_placement

    class Group(FakeGroup):
        def __init__(self, layout, rank_options, **kwargs) -> None:
            super().__init__(rank_options, events)
            self.ranks = []

        def build(self, factory) -> None:
            events.append(f"{self.name}.build")
            if on_build:
                on_build(self.name)

    class Placement:
        def __init__(self, plan) -> None:
            self.use_gpus = use_gpus

        def rank_options(self, role: str) -> str: return role
        def check_ranks(self, role, gpu_ids) -> None: ...
        def engine_options(self, i: int) -> dict: return {}

    def launch(model_path, name, **kwargs):
        events.append(f"{name}.launch")
        if on_launch:
            on_launch(name)
        return FakeEngine(name, events)

    monkeypatch.setattr(worker_group, "MegatronWorkerGroup", Group)
    monkeypatch.setattr(main_ppo, "Placement", Placement)
    monkeypatch.setattr(engine_actor.EngineClient, "launch", staticmethod(launch))
    monkeypatch.setattr(weight_sync, "WeightSync", lambda *args, **kwargs: FakeSync(events))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", staticmethod(lambda path, **kwargs: None))
    trainer, _ = make_trainer(tmp_path, OFFLOAD + ["trainer.n_gpus_per_node=2"], colocated=use_gpus)
    try:
        return main_ppo.build_workers(trainer.cfg, "model", plan_placement(trainer.cfg))
    finally:
        trainer.close()


@pytest.mark.unit
def test_workers_are_built_offloaded_before_any_engine_starts(tmp_path, monkeypatch):
    """Contract (hybrid, offload on): `build_workers` offloads every Megatron group's state before it launches the
    first engine, so the engines size their KV cache on GPUs free of training state."""
    events: list[str] = []
    build_with_recorders(tmp_path, monkeypatch, True, events)
    assert events[:8] == ["actor.build", "ref.build", "critic.build", "actor.offload", "ref.offload",
                          "critic.offload", "engine0.launch", "engine1.launch"]


@pytest.mark.unit
def test_engines_without_shared_gpu_memory_start_while_the_ranks_build(tmp_path, monkeypatch):
    """Contract: where engines share no GPU memory with the ranks (here: no GPUs), every engine's launch is under
    way while the actor group builds: the actor's build waits for both launches to begin and each launch waits for
    the actor's build, which only completes if they overlap. The workers come back whole, engines in order."""
    import threading

    events: list[str] = []
    launched = {name: threading.Event() for name in ("engine0", "engine1")}
    actor_building = threading.Event()

    def on_build(role: str) -> None:
        if role == "actor":
            actor_building.set()
            assert all(e.wait(10) for e in launched.values()), "the engines did not start during the actor's build"

    def on_launch(name: str) -> None:
        launched[name].set()
        assert actor_building.wait(10), f"{name} launched but the actor never built alongside it"

    workers = build_with_recorders(tmp_path, monkeypatch, False, events, on_build, on_launch)
    assert [e.name for e in workers.engines] == ["engine0", "engine1"] and not workers.colocated
    assert events.index("critic.offload") > events.index("actor.build")


@pytest.mark.unit
def test_separate_placement_never_releases_engines_and_offload_off_never_moves_state(tmp_path):
    """Contract: engines on their own GPUs keep their memory (no release / resume), and with no
    `*_offload` key set the Megatron state is never moved; the step still trains then syncs."""
    trainer, events = make_trainer(tmp_path, [k.replace("=true", "=false") for k in OFFLOAD], colocated=False)
    trainer.step(1, prompts)
    assert phases(events) == ["rollout", "train", "sync v1"]
    trainer.close()
    assert events[-5:] == ["actor.shutdown", "ref.shutdown", "critic.shutdown", "engine0.shutdown", "engine1.shutdown"]


@pytest.mark.unit
def test_deterministic_rollouts_are_seeded_by_trainer_seed_and_step_only(tmp_path):
    """Contract: with rollout.deterministic, each step's rollout gets a seed that depends on trainer.seed and the
    step alone (so a resumed run samples what the uninterrupted one did); without it, no seed."""
    def seeds(name: str, *overrides: str) -> list[int | None]:
        (tmp_path / name).mkdir()
        trainer, _ = make_trainer(tmp_path / name, list(overrides), colocated=False)
        for step in (1, 2):
            trainer.step(step, prompts)
        trainer.close()
        return trainer.agent_loop.seeds

    on = seeds("a", "actor_rollout_ref.rollout.deterministic=true", "trainer.seed=3")
    assert on == seeds("b", "actor_rollout_ref.rollout.deterministic=true", "trainer.seed=3")
    assert len(set(on)) == 2 and None not in on
    assert set(on).isdisjoint(seeds("c", "actor_rollout_ref.rollout.deterministic=true", "trainer.seed=4"))
    assert seeds("d", "trainer.seed=3") == [None, None]
