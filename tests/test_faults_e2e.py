"""End to end: faults in `python -m recipe.main_ppo` runs on the cpu_tiny preset (one SGLang CPU engine, the
Megatron actor and reference on one bundle; the GSM8K parquet and custom reward of tests/test_trainer_e2e.py).

One run, then its rerun, cover the contracts (two trainer starts in all, to keep the suite short):
1. During step 2 (checkpoint 1 complete) the engine's SGLang scheduler is SIGKILLed: its actor dies, the step's
   trajectories fail and the step is not trained on; the engine is restarted on its bundle, synced and checked,
   and step 3 trains (its metrics show the restart).
2. During step 4's training phase (checkpoint 3 complete, a Megatron rank busy in a call) that rank is SIGKILLed:
   the run exits non-zero with one line naming the role and the rank.
3. The same command rerun with `max_engine_restarts=0` resumes from checkpoint 3; its engine's scheduler is killed
   again: the run exits non-zero with one line naming the engine and what happened.
After each exit, no process of the run's session is left.
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
from recipe.data import gsm8k
from tests.test_trainer_e2e import CUSTOM_REWARD, RECORDS

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 900  # a guard against a hung run, not a timing check


def _command(root: Path, out: Path, restarts: int) -> list[str]:
    return [sys.executable, "-m", "recipe.main_ppo", "--config-name", "cpu_tiny",
            f"data.train_files=[{root / 'data' / 'train.parquet'}]", f"trainer.default_local_dir={out}",
            "trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.resume_mode=auto",
            "trainer.logger=[console]", f"custom_reward_function.path={root / 'reward.py'}",
            "data.max_response_length=24", "trainer.collective_timeout_s=120",
            f"actor_rollout_ref.rollout.max_engine_restarts={restarts}"]


def _start(root: Path, out: Path, log: Path, restarts: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("ab") as f:
        return subprocess.Popen(_command(root, out, restarts), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its Ray cluster, ranks and engine: one session


def _session(sid: int) -> list[psutil.Process]:
    procs = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                procs.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return procs


def _named(sid: int, prefix: str) -> list[psutil.Process]:
    out = []
    for p in _session(sid):
        try:
            if " ".join(p.cmdline()).startswith(prefix):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _wait_for(proc: subprocess.Popen, log: Path, what: str, cond) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert proc.poll() is None, f"the trainer exited before {what}:\n" + log.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.1)


def _kill_scheduler(proc: subprocess.Popen) -> None:
    (scheduler,) = _named(proc.pid, "sglang::scheduler")
    scheduler.send_signal(signal.SIGKILL)


def _exit(proc: subprocess.Popen, log: Path) -> tuple[int, list[psutil.Process]]:
    """The run's exit code and what is left of its session once it exited (the session's processes are killed
    afterwards either way, so a failing check leaves nothing behind)."""
    try:
        rc = proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = _session(proc.pid)
    for _ in range(120):  # Ray's own processes stop shortly after the driver
        if not left:
            break
        time.sleep(0.5)
        left = _session(proc.pid)
    names = [p.name() for p in left if p.is_running()]
    for p in left:
        p.kill()
    return rc, names


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


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
    proc = _start(root, out, log, restarts=1)
    try:
        _wait_for(proc, log, "checkpoint 1", lambda: checkpoint.latest_step(out) == 1)
        _kill_scheduler(proc)  # step 2 starts with its rollout right after checkpoint 1
        _wait_for(proc, log, "checkpoint 3 and step 4's training phase",
                  lambda: checkpoint.latest_step(out) == 3 and _named(proc.pid, "ray::RankWorker.call"))
        killed = _named(proc.pid, "ray::RankWorker.call")[0]
        killed.send_signal(signal.SIGKILL)
    finally:
        first = _exit(proc, log)
    rerun_log = root / "rerun.log"
    proc = _start(root, out, rerun_log, restarts=0)
    try:
        _wait_for(proc, rerun_log, "the resume", lambda: "resumed from" in rerun_log.read_text(errors="replace"))
        _kill_scheduler(proc)
    finally:
        rerun = _exit(proc, rerun_log)
    return {"out": out, "first": first, "first_log": log, "rerun": rerun, "rerun_log": rerun_log}


@pytest.mark.e2e
def test_a_killed_engine_is_restarted_and_the_run_continues(runs):
    """Contract: the engine killed during step 2 is restarted, synced to the current weights and checked; step 2
    (its trajectories all failed) is not trained on, step 3 trains, and its metrics count the restart."""
    log = runs["first_log"].read_text(errors="replace")
    assert "engine engine0: its actor died during request" in log
    assert "engine engine0 restarted, synced to weight version 1 and checked" in log
    steps = {m["step"]: m for m in _metrics(runs["out"])}
    assert sorted(steps) == [1, 2, 3]
    assert steps[2]["fault/failed_fraction"] == 1.0 and steps[2]["fault/skipped_steps"] == 1
    assert "actor/grad_norm" not in steps[2] and "actor/grad_norm" in steps[1]
    assert steps[3]["fault/engine_restarts"] == 1 and "actor/grad_norm" in steps[3]
    assert steps[3]["rollout/finish/error"] == 0 and steps[3]["rollout/weight_version_min"] == 1


@pytest.mark.e2e
def test_a_killed_megatron_rank_stops_the_run_naming_it_and_leaves_no_process(runs):
    """Contract: a Megatron rank killed during step 4's training phase ends the run with a non-zero exit and a last
    line naming the role and the rank; no process of the run is left."""
    rc, left = runs["first"]
    assert rc != 0 and left == []
    assert re.fullmatch(r"polyturn: error: Megatron (actor|ref) rank 0 \(tp 0, pp 0, dp 0\) died during "
                                      r"\w+ \(\w+\); rerun the same command to resume from the last checkpoint",
                                      _last_line(runs["first_log"]))


@pytest.mark.e2e
def test_the_rerun_resumes_and_with_no_restart_left_a_killed_engine_stops_it(runs):
    """Contract: rerunning the command resumes from the last checkpoint (3); with max_engine_restarts=0 the engine
    killed again stops the run: non-zero exit, a last line naming the engine and the key, no process left."""
    rc, left = runs["rerun"]
    assert rc != 0 and left == []
    assert f"resumed from {runs['out'] / 'global_step_3'}: step 3" in runs["rerun_log"].read_text(errors="replace")
    assert _last_line(runs["rerun_log"]).startswith("polyturn: error: engine engine0: ")
    assert _last_line(runs["rerun_log"]).endswith(
        "restarts are off (actor_rollout_ref.rollout.max_engine_restarts=0): stopping the run")
