"""End to end: a trainer killed with SIGKILL during step k+1 and started again with `trainer.resume_mode=auto`
continues from checkpoint k and ends exactly where an uninterrupted run ends: the same metrics and the same
weights, Adam state and scheduler, bit for bit.

Real parts: `python -m recipe.main_ppo` processes on the cpu_tiny preset under the one_step_off schedule (so the
checkpoint also holds work in flight: step k+1's rollout, done ahead while step k trained), the Megatron actor at
DP=2 with the distributed optimizer (Adam state sharded over the DP ranks), one SGLang CPU engine on its own bundle
with reproducible rollouts (`actor_rollout_ref.rollout.deterministic`), and the verl-style custom reward of
tests/test_trainer_e2e.py (scores vary between samples, so the steps really train). k = 1; the kill comes once
checkpoint 1 is marked complete (step 2 then trains on the rollout saved in it), not after a guessed sleep. The
uninterrupted run also shows a checkpoint written after every step and `auto` picking the newest. A resumed sync run
sampling from the restored weights is tests/test_faults_e2e.py's rerun. The module's three launches run one after
the other (`runs`).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from recipe import checkpoint
from recipe.tasks import gsm8k
from tests.test_trainer_e2e import CUSTOM_REWARD, RECORDS

REPO = Path(__file__).resolve().parents[1]
STEPS = 2  # k + 1
ROLLOUT_STARTS = "rollout started: "  # the agent loop's log line: a rollout began
# the engine on a bundle of its own, which one_step_off needs (it rolls out while the actor trains)
ONE_STEP_OFF = ("async_training.schedule=one_step_off", "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1",
                "rollout.n_gpus_per_node=1")
MINI_BATCHES = 2  # data.train_batch_size 4 / ppo_mini_batch_size 2: optimizer steps per trainer step
WALL_CLOCK = ("timing/", "perf/", "weight_sync/seconds", "weight_sync/send_seconds", "weight_sync/peak_extra_mb")
pytestmark = pytest.mark.timeout(1800)  # the first test's setup holds the module's three launches (`runs`)


def _command(root: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "recipe.main_ppo", "--config-name", "cpu_tiny",
            f"data.train_files=[{root / 'data' / 'train.parquet'}]", f"trainer.default_local_dir={out}",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.resume_mode=auto",
            "trainer.logger=[console,wandb]", f"custom_reward_function.path={root / 'reward.py'}",
            "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.optim.use_distributed_optimizer=true", "data.max_response_length=24",
            "actor_rollout_ref.rollout.deterministic=true",
            "trainer.n_gpus_per_node=2", "ray_init.num_cpus=4", *ONE_STEP_OFF]


def _start(root: Path, out: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("ab") as f:
        return subprocess.Popen(_command(root, out), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its Ray cluster and engine: one process group


def _finish(proc: subprocess.Popen, log: Path) -> None:
    rc = proc.wait(timeout=900)
    assert rc == 0, f"trainer exited {rc}:\n" + log.read_text()[-4000:]


def _kill_session(sid: int, settle_s: float = 30.0) -> None:
    """SIGKILL what is left of the killed trainer's session (Ray's head processes, its workers in process groups of
    their own, the engine), as a machine's crash or a job scheduler would, and wait until none of it runs: the next
    run starts on a clean machine."""
    deadline = time.monotonic() + settle_s
    while (left := _session(sid)) and time.monotonic() < deadline:
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        time.sleep(0.2)


def _session(sid: int) -> list[psutil.Process]:
    """The running processes of session `sid` (zombies left to their reaper do not count)."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _step_metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _prepare(root: Path) -> None:
    """The runs' data (verl-format parquet) and custom reward under `root`."""
    for split in gsm8k.SPLITS:
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    gsm8k.preprocess(root / "data", root)
    (root / "reward.py").write_text(CUSTOM_REWARD)


def _kill_during_step_2(root: Path, out: Path, log: Path) -> dict:
    """Start the run and SIGKILL it once checkpoint 1 is marked complete (step 2 then trains on its saved rollout);
    what it left behind: its exit code, the marker, the steps logged and the checkpoint directories."""
    proc = _start(root, out, log)
    try:
        deadline = time.monotonic() + 900
        while checkpoint.latest_step(out) != 1:
            assert proc.poll() is None, "the trainer exited before step 2:\n" + log.read_text()[-4000:]
            assert time.monotonic() < deadline, "checkpoint 1 never came"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        killed_rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_session(proc.pid)
    return {"rc": killed_rc, "marker": checkpoint.latest_step(out), "steps": [m["step"] for m in _step_metrics(out)],
            "dirs": sorted(p.name for p in out.glob("global_step_*"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's three trainer launches, one after the other (each its own Ray cluster and engine; the runs are
    deterministic): the uninterrupted run, the run killed during step 2, then its auto-resume. Two launches side by
    side on this 2-core machine once starved a third process's `ray.init` ("Failed to get node info: Deadline
    Exceeded")."""
    root = tmp_path_factory.mktemp("resume_kill")
    _prepare(root)
    _finish(_start(root, root / "uninterrupted", root / "uninterrupted.log"), root / "uninterrupted.log")
    out = root / "out"
    after_kill = _kill_during_step_2(root, out, root / "killed.log")
    _finish(_start(root, out, root / "resumed.log"), root / "resumed.log")
    return {"out": out, "after_kill": after_kill, "resumed_log": (root / "resumed.log").read_text(errors="replace"),
            "reference": root / "uninterrupted"}


@pytest.mark.e2e
def test_sigkill_during_step_2_then_auto_resume_continues_from_checkpoint_1(runs):
    """Contract: killed during step 2 (checkpoint 1 complete, step 2 unfinished), the auto-resumed run restores
    checkpoint 1 and runs step 2 only, on the rollout saved in it (sampled at version 0 while step 1 trained: not
    rolled out again); checkpoint 2 holds every rank's Adam shard continued from checkpoint 1 (its step counts both
    trainer steps), the scheduler's position and the trainer state under the killed run's wandb id."""
    out = runs["out"]
    assert runs["after_kill"] == {"rc": -signal.SIGKILL, "marker": 1, "steps": [1], "dirs": ["global_step_1"]}
    assert f"resumed from {out / 'global_step_1'}: step 1, weight version 1" in runs["resumed_log"]
    assert runs["resumed_log"].count(ROLLOUT_STARTS) == 0  # step 2's rollout came from the checkpoint
    metrics = _step_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    step2 = metrics[1]
    assert step2["rollout/weight_version_min"] == 0 and step2["rollout/staleness/max"] == 1.0
    assert step2["trainer/weight_version"] == 2
    assert step2["actor/grad_norm"] > 0 and step2["critic/advantages/max"] > 0  # the step really trained

    actor = out / "global_step_2" / "actor"
    shards = {p.name: torch.load(p, map_location="cpu", weights_only=False) for p in sorted(actor.glob("*.pt"))}
    assert sorted(shards) == [f"rank_{r:05d}.pt" for r in range(2)]
    coords = sorted(s["coords"] for s in shards.values())
    assert coords == [(0, 0, d) for d in range(2)]  # TP=1 x DP=2
    for name, s in shards.items():
        assert s["step"] == 2 * MINI_BATCHES and s["scheduler"]["num_steps"] == 2 * MINI_BATCHES, name
        entries = [e for opt in s["optimizer_shards"] for gbuf, by_dtype in opt.items() if isinstance(gbuf, int)
                   for buckets in by_dtype.values() for bucket in buckets for e in bucket]
        assert entries and all(int(e["step"]) == 2 * MINI_BATCHES for e in entries), name  # Adam continued
        assert all(e["exp_avg_sq"].abs().sum() > 0 for e in entries), name
    # the DP ranks hold disjoint halves of the Adam state
    for t in range(1):
        sizes = [sum(e["exp_avg"].numel() for opt in s["optimizer_shards"] for g, by in opt.items()
                     if isinstance(g, int) for bs in by.values() for b in bs for e in b)
                 for s in shards.values() if s["coords"][0] == t]
        params = sum(v.numel() for s in shards.values() if s["coords"] == (t, 0, 0) for k, v in s["model"].items()
                     if torch.is_tensor(v) and not k.endswith("_extra_state"))
        assert len(sizes) == 2 and sum(sizes) == params
    state = checkpoint.TrainerState.read(out / "global_step_2")
    assert (state.step, state.weight_version, state.batches_consumed) == (2, 2, 2)
    assert state.wandb_run_id == checkpoint.TrainerState.read(out / "global_step_1").wandb_run_id is not None


def _without_wall_clock(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(WALL_CLOCK)}


def _differences(a, b, path: str = "") -> list[str]:
    """Where two checkpoint objects differ (tensors bit for bit, the rest by ==)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # numpy's RNG state
        return [] if np.array_equal(a, b) else [path]
    return [] if a == b else [path]


@pytest.mark.e2e
def test_killed_and_resumed_run_equals_the_uninterrupted_run_bit_for_bit(runs):
    """Contract (in-flight work saved, not lost): with rollout.deterministic, the run killed during step 2 and
    resumed logs the metrics of an uninterrupted run for both steps (everything but wall-clock figures, bit for bit)
    and ends with the same checkpoint: every rank's weights, Adam moments, main params, scheduler and RNG, and the
    same trainer state."""
    ref = runs["reference"]
    assert [_without_wall_clock(m) for m in _step_metrics(runs["out"])] == \
        [_without_wall_clock(m) for m in _step_metrics(ref)]
    for rank in range(2):
        name = f"rank_{rank:05d}.pt"
        resumed, uninterrupted = (torch.load(d / "global_step_2" / "actor" / name, map_location="cpu",
                                             weights_only=False) for d in (runs["out"], ref))
        assert _differences(resumed, uninterrupted) == [], name
    states = [checkpoint.TrainerState.read(d / "global_step_2") for d in (runs["out"], ref)]
    assert states[0].wandb_run_id != states[1].wandb_run_id  # two runs; all else equal
    assert {**vars(states[0]), "wandb_run_id": None} == {**vars(states[1]), "wandb_run_id": None}


@pytest.mark.e2e
def test_uninterrupted_run_checkpoints_every_step_and_auto_picks_the_newest(runs):
    """Contract: save_freq=1 writes global_step_<k> after each step, the marker names the newest, which auto resume
    picks; the trainer state holds the step, the weight version, the sampler position (past the batch rolled out
    ahead) and the wandb id."""
    ref = runs["reference"]
    assert sorted(p.name for p in ref.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert checkpoint.resume_dir("auto", ref, None) == ref / "global_step_2"
    state = checkpoint.TrainerState.read(ref / "global_step_1")
    assert (state.step, state.weight_version, state.batches_consumed) == (1, 1, 2)  # step 2's batch, rolled out ahead
    assert state.wandb_run_id is not None and state.wandb_run_id == checkpoint.TrainerState.read(
        ref / "global_step_2").wandb_run_id
