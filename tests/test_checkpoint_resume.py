"""Trainer checkpoints (recipe.checkpoint): atomic save, the `latest` marker, retention, what `auto` resumes after
a save dies part-way (an exception, or SIGKILL of the saving process), and the config keys."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from recipe import checkpoint
from recipe.checkpoint import MARKER, TrainerState
from recipe.config_schema import ConfigError, TrainerConfig

REPO = Path(__file__).resolve().parents[1]


def _state(step: int) -> TrainerState:
    return TrainerState(step=step, weight_version=step, kl_coef=0.001 * step, batches_consumed=step, epoch=0,
                        wandb_run_id="abc123")


def _writer(step: int):
    def write(d: Path) -> None:
        (d / "actor").mkdir()
        (d / "actor" / "rank_00000.pt").write_bytes(b"shard %d" % step)
        _state(step).write(d)
    return write


def _step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("global_step_", ".tmp")))


@pytest.mark.unit
def test_save_renames_into_place_then_marks_and_auto_resumes_the_marked_step(tmp_path):
    """Contract: a save leaves global_step_<k>/ with the written files and the trainer state, the marker names k,
    and auto resume returns that directory with its state; disable returns nothing; without a marker auto starts
    over."""
    assert checkpoint.resume_dir("auto", tmp_path, None) is None
    for step in (1, 2):
        assert checkpoint.save(tmp_path, step, _writer(step)) == tmp_path / f"global_step_{step}"
    assert (tmp_path / MARKER).read_text().strip() == "2"
    assert _step_dirs(tmp_path) == ["global_step_1", "global_step_2"]  # no temp dir left
    resumed = checkpoint.resume_dir("auto", tmp_path, None)
    assert resumed == tmp_path / "global_step_2"
    assert TrainerState.read(resumed) == _state(2)
    assert (resumed / "actor" / "rank_00000.pt").read_bytes() == b"shard 2"
    assert checkpoint.resume_dir("disable", tmp_path, None) is None
    assert checkpoint.resume_dir("resume_path", tmp_path, str(tmp_path / "global_step_1")) == tmp_path / "global_step_1"


@pytest.mark.unit
def test_retention_keeps_the_newest_checkpoints_after_the_new_one_is_complete(tmp_path):
    """Contract: with max_actor_ckpt_to_keep=2 only the two newest checkpoints stay; a failed save removes nothing."""
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, _writer(step), max_keep=2)
    assert _step_dirs(tmp_path) == ["global_step_2", "global_step_3"]

    def fail(d: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 4, fail, max_keep=2)
    assert _step_dirs(tmp_path) == [".tmp_global_step_4", "global_step_2", "global_step_3"]
    checkpoint.save(tmp_path, 4, _writer(4), max_keep=2)
    assert _step_dirs(tmp_path) == ["global_step_3", "global_step_4"]  # the failed save's temp dir is gone too


@pytest.mark.unit
def test_failure_between_rename_and_marker_leaves_auto_on_the_previous_checkpoint(tmp_path, monkeypatch):
    """Contract: auto resume goes by the marker only: a checkpoint renamed into place but never marked (the save
    died before the marker was replaced) is not resumed; the previous marker stays intact."""
    checkpoint.save(tmp_path, 1, _writer(1))

    def die(path: Path, text: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_write_atomic", die)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, _writer(2))
    assert (tmp_path / "global_step_2").is_dir()
    assert checkpoint.resume_dir("auto", tmp_path, None) == tmp_path / "global_step_1"


SAVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from recipe import checkpoint

    root, ready = Path(sys.argv[1]), Path(sys.argv[2])

    def write(d):
        (d / "actor").mkdir()
        (d / "actor" / "rank_00000.pt").write_bytes(b"half a shard")
        ready.write_text("writing")
        time.sleep(60)  # killed here, mid-save

    checkpoint.save(root, 2, write)
""")


@pytest.mark.unit
def test_sigkill_during_a_save_leaves_the_last_complete_checkpoint_as_what_auto_resumes(tmp_path):
    """Contract: a process killed with SIGKILL while writing checkpoint 2 leaves no global_step_2 and the marker
    on step 1, which auto resumes; the next save cleans the half-written temp dir and completes."""
    checkpoint.save(tmp_path, 1, _writer(1))
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path), str(ready)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, "the saver exited before writing"
            assert time.monotonic() < deadline, "the saver never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _step_dirs(tmp_path) == [".tmp_global_step_2", "global_step_1"]
    assert checkpoint.resume_dir("auto", tmp_path, None) == tmp_path / "global_step_1"
    assert TrainerState.read(tmp_path / "global_step_1") == _state(1)
    checkpoint.save(tmp_path, 2, _writer(2))
    assert _step_dirs(tmp_path) == ["global_step_1", "global_step_2"]
    assert checkpoint.resume_dir("auto", tmp_path, None) == tmp_path / "global_step_2"


@pytest.mark.unit
def test_resume_errors_name_the_key_and_the_fix(tmp_path):
    """Contract: a marker naming a missing checkpoint, a resume path that is not a checkpoint, and bad
    trainer.save_freq / resume_mode / resume_from_path / max_actor_ckpt_to_keep values are refused by name."""
    (tmp_path / MARKER).write_text("7\n")
    with pytest.raises(FileNotFoundError, match="names step 7 but .*global_step_7 is missing"):
        checkpoint.resume_dir("auto", tmp_path, None)
    with pytest.raises(FileNotFoundError, match="trainer.resume_from_path"):
        checkpoint.resume_dir("resume_path", tmp_path, str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not a complete polyturn checkpoint"):
        TrainerState.read(tmp_path)
    out = str(tmp_path / "out")
    for kwargs, match in [({"save_freq": 0}, "trainer.save_freq"), ({"resume_mode": "latest"}, "trainer.resume_mode"),
                          ({"resume_mode": "resume_path"}, "trainer.resume_from_path"),
                          ({"resume_mode": "resume_path", "resume_from_path": str(tmp_path / "nope")},
                           "trainer.resume_from_path"),
                          ({"max_actor_ckpt_to_keep": 0}, "trainer.max_actor_ckpt_to_keep")]:
        with pytest.raises(ConfigError, match=match):
            TrainerConfig(default_local_dir=out, **kwargs)
    cfg = TrainerConfig(default_local_dir=out, save_freq=2, resume_mode="resume_path",
                        resume_from_path=str(tmp_path), max_actor_ckpt_to_keep=3)
    assert cfg.resume_from_path == str(tmp_path.resolve())


@pytest.mark.unit
def test_tracking_continues_the_wandb_run_saved_in_a_checkpoint(tmp_path):
    """Contract: a Tracking given the run id from a checkpoint's trainer state logs to that same wandb run
    (offline here: a second offline run dir under the same id, which `wandb sync` appends to the run)."""
    from recipe.tracking import Tracking

    first = Tracking(["wandb"], "polyturn-test", "resume", tmp_path)
    run_id = first.run_id
    first.log({"actor/pg_loss": 1.0}, 1)
    first.finish()
    again = Tracking(["wandb"], "polyturn-test", "resume", tmp_path, run_id=run_id)
    assert again.run_id == run_id
    again.log({"actor/pg_loss": 2.0}, 2)
    again.finish()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)  # offline-run-<time>-<id>[-<n>]
