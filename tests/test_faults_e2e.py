"""End to end: faults in `python -m recipe.main_ppo` runs on the cpu_tiny preset's model, data and custom reward (of
tests/test_trainer_e2e.py), with the Megatron actor at TP=2 (no reference: use_kl_loss=false) and the SGLang CPU engine
on a bundle of its own. So weights reach the engine by the distributed path, a process group that a restarted engine
must join anew, and a killed actor rank leaves its TP peer in a collective.

One run, then its rerun, cover the contracts (two trainer starts in all, to keep the suite short; a checkpoint
every 2 steps, so the killed run leaves a step logged but not checkpointed, as a crash between saves does):
1. During step 2's rollout the engine's SGLang scheduler is SIGKILLed: its actor dies, the step's trajectories fail
   and the step is not trained on; the engine is restarted on its bundle, synced through a new process group and
   checked, and no process of the old engine is left; step 3 trains on it and its metrics show the restart.
2. During step 4's update_policy (checkpoint 2 complete, step 3 logged) actor rank 1 is SIGKILLed, found by its
   process title (each rank's Ray task is named after its role, rank and call, see megatron_workers.worker_group):
   the run exits non-zero within trainer.collective_timeout_s, its last line naming the role and the rank.
3. The same command rerun with max_engine_restarts=0 resumes from checkpoint 2 and trains step 3 again (metrics.jsonl
   then holds each step once); its engine's scheduler is killed in step 4's rollout: the run exits non-zero within
   trainer.rollout_timeout_s, its last line naming the engine.
After each exit no process of the run's session is left.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from recipe import checkpoint
from recipe.tasks import gsm8k
from tests.test_trainer_e2e import CUSTOM_REWARD, RECORDS

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 900  # a guard against a hung run, not a timing check
COLLECTIVE_TIMEOUT_S = 60  # trainer.collective_timeout_s
ROLLOUT_TIMEOUT_S = 60  # trainer.rollout_timeout_s
SHUTDOWN_SLACK_S = 60  # the run's own shutdown after the fault (engine, ranks, Ray) on a loaded machine
ROLLOUT_STARTS = "rollout started: "  # the agent loop's log line: a rollout began
RESTARTED = "engine engine0 restarted, synced to weight version 1 and checked"


def _command(root: Path, out: Path, restarts: int) -> list[str]:
    return [sys.executable, "-m", "recipe.main_ppo", "--config-name", "cpu_tiny",
            f"data.train_files=[{root / 'data' / 'train.parquet'}]", f"trainer.default_local_dir={out}",
            "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.resume_mode=auto",
            "trainer.logger=[console]", f"custom_reward_function.path={root / 'reward.py'}",
            "actor_rollout_ref.actor.use_kl_loss=false", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
            "ray_init.num_cpus=3", f"trainer.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
            f"trainer.rollout_timeout_s={ROLLOUT_TIMEOUT_S}",
            f"actor_rollout_ref.rollout.max_engine_restarts={restarts}"]


def _start(root: Path, out: Path, log: Path, restarts: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("ab") as f:
        return subprocess.Popen(_command(root, out, restarts), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its Ray cluster, ranks and engine: one session


def _named(sid: int, prefix: str) -> list[psutil.Process]:
    """The processes of session `sid` whose command line (a process title, for Ray and SGLang) starts with `prefix`."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and " ".join(p.cmdline()).startswith(prefix):
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def _wait_for(proc: subprocess.Popen, log: Path, what: str, cond):
    """`cond()`'s first truthy value, polled while the run lives."""
    deadline = time.monotonic() + DEADLINE_S
    while not (value := cond()):
        assert proc.poll() is None, f"the trainer exited before {what}:\n" + log.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.05)
    return value


def _rollouts(log: Path) -> int:
    return log.read_text(errors="replace").count(ROLLOUT_STARTS)


def _kill(proc: subprocess.Popen, log: Path, what: str, prefix: str) -> float:
    """SIGKILL the run's first process titled `prefix...` as soon as there is one; the time of the kill."""
    _wait_for(proc, log, what, lambda: _named(proc.pid, prefix))[0].send_signal(signal.SIGKILL)
    return time.monotonic()


def _exit(proc: subprocess.Popen, killed_at: float) -> dict:
    """The run's exit code, the seconds from the kill to its exit, and what is left of its session once it exited
    (killed afterwards either way, so a failing check leaves nothing behind)."""
    try:
        rc = proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    seconds = time.monotonic() - killed_at
    left = _named(proc.pid, "")
    for _ in range(120):  # Ray's own processes stop shortly after the driver
        if not left:
            break
        time.sleep(0.5)
        left = _named(proc.pid, "")
    names = [p.name() for p in left if p.is_running()]
    for p in left:
        p.kill()
    return {"rc": rc, "seconds": seconds, "left": names}


ONE_ENGINE = {"ray::EngineActor": 1, "sglang::scheduler": 1, "sglang::detokenizer": 1}  # its processes, by title


def _engine_processes(sid: int, settle_s: float = 30.0) -> dict[str, int]:
    """How many processes of each kind in ONE_ENGINE session `sid` holds, once that is one each (or `settle_s`
    passed: a killed process takes a moment to go)."""
    deadline = time.monotonic() + settle_s
    while (counts := {name: len(_named(sid, name)) for name in ONE_ENGINE}) != ONE_ENGINE \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    return counts


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _last_line(log: Path) -> str:
    return log.read_text(errors="replace").strip().splitlines()[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    for split in gsm8k.SPLITS:
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    gsm8k.preprocess(root / "data", root)
    (root / "reward.py").write_text(CUSTOM_REWARD)
    out, log = root / "out", root / "first.log"
    proc, killed_at = _start(root, out, log, restarts=1), time.monotonic()
    try:
        _wait_for(proc, log, "step 2's rollout", lambda: _rollouts(log) >= 2)
        _kill(proc, log, "the engine's scheduler", "sglang::scheduler")
        _wait_for(proc, log, "the engine's restart", lambda: RESTARTED in log.read_text(errors="replace"))
        engine_processes = _engine_processes(proc.pid)
        _wait_for(proc, log, "step 3's metrics", lambda: len(_metrics(out)) == 3)
        killed_at = _kill(proc, log, "step 4's update_policy", "ray::actor.rank1.update_policy")
    finally:
        first = _exit(proc, killed_at)
    first_metrics, first_checkpoint = _metrics(out), checkpoint.latest_step(out)
    rerun_log = root / "rerun.log"
    proc = _start(root, out, rerun_log, restarts=0)
    killed_at = time.monotonic()
    try:
        _wait_for(proc, rerun_log, "the rerun's second rollout", lambda: _rollouts(rerun_log) >= 2)
        killed_at = _kill(proc, rerun_log, "the engine's scheduler", "sglang::scheduler")
    finally:
        rerun = _exit(proc, killed_at)
    return {"out": out, "first": first, "first_log": log, "engine_processes": engine_processes,
            "first_metrics": first_metrics, "first_checkpoint": first_checkpoint, "rerun": rerun,
            "rerun_log": rerun_log}


@pytest.mark.e2e
def test_a_killed_engine_is_restarted_resynced_and_the_run_continues(runs):
    """Contract: the engine killed during step 2's rollout is restarted on its bundle (no process of the old one
    left), synced to the current weights through a new process group and checked; step 2 (its trajectories all
    failed) is not trained on, step 3 trains on the restarted engine, and its metrics count the restart."""
    log = runs["first_log"].read_text(errors="replace")
    assert "engine engine0: its actor died during request" in log
    assert RESTARTED in log
    assert runs["engine_processes"] == ONE_ENGINE
    steps = {m["step"]: m for m in runs["first_metrics"]}
    assert sorted(steps) == [1, 2, 3]
    assert steps[2]["fault/failed_fraction"] == 1.0 and steps[2]["fault/skipped_steps"] == 1
    assert "actor/grad_norm" not in steps[2] and "actor/grad_norm" in steps[1]
    assert steps[3]["fault/engine_restarts"] == 1 and "actor/grad_norm" in steps[3]
    assert steps[3]["rollout/finish/error"] == 0 and steps[3]["rollout/weight_version_min"] == 1


@pytest.mark.e2e
def test_a_rank_killed_mid_update_stops_the_run_within_the_timeout_naming_it(runs):
    """Contract: actor rank 1 killed in step 4's update_policy ends the run with a non-zero exit within
    trainer.collective_timeout_s (its TP peer is not left hanging), a last line naming the role, the rank and the
    call, and no process of the run left."""
    first = runs["first"]
    assert first["rc"] != 0 and first["left"] == []
    assert first["seconds"] < COLLECTIVE_TIMEOUT_S + SHUTDOWN_SLACK_S
    assert re.fullmatch(r"polyturn: error: Megatron actor rank 1 \(tp 1, pp 0, dp 0\) died during update_policy "
                        r"\(\w+\); rerun the same command to resume from the last checkpoint",
                        _last_line(runs["first_log"]))


@pytest.mark.e2e
def test_the_rerun_resumes_keeps_each_step_once_and_with_no_restart_allowed_a_killed_engine_stops_it(runs):
    """Contract: rerunning the command resumes from the last checkpoint (2, though step 3 was logged) and trains
    step 3 again, sampled by its engine from the restored weights: metrics.jsonl holds each step once, step 3's
    record the rerun's. With max_engine_restarts=0 the engine killed in step 4's rollout stops the run within
    trainer.rollout_timeout_s: non-zero exit, a last line naming the engine and the key, no process left."""
    assert runs["first_checkpoint"] == 2
    assert f"resumed from {runs['out'] / 'global_step_2'}: step 2" in runs["rerun_log"].read_text(errors="replace")
    metrics = _metrics(runs["out"])
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[:2] == runs["first_metrics"][:2]
    assert metrics[2]["fault/engine_restarts"] == 0 and "actor/grad_norm" in metrics[2]  # the rerun's own step 3
    # its engine sampled step 3 from the restored actor: checkpoint 2's version (1: step 2 trained nothing, its
    # engine died), with the actor's log-probs
    assert metrics[2]["rollout/weight_version_min"] == 1 and metrics[2]["training/rollout_probs_diff_max"] < 1e-3
    rerun = runs["rerun"]
    assert rerun["rc"] != 0 and rerun["left"] == []
    assert rerun["seconds"] < ROLLOUT_TIMEOUT_S + SHUTDOWN_SLACK_S
    assert re.fullmatch(r"polyturn: error: engine engine0: its actor died during request \S+ \(\w+\); restarts are "
                        r"off \(actor_rollout_ref.rollout.max_engine_restarts=0\): stopping the run",
                        _last_line(runs["rerun_log"]))
