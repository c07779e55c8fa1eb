"""recipe.tracking: the console line leads with the headline metrics, and the run's record files (metrics.jsonl,
per-step JSONL dumps) hold each step once, for a fresh run in an old run's directory and for a resumed run."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from recipe.tracking import Tracking, console_line


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def _write(path: Path, steps: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "x": float(s)}) + "\n" for s in steps))


@pytest.mark.unit
def test_console_line_leads_with_the_ten_headline_metrics_then_the_rest_by_name():
    """Contract: score, val score, response length, tool-call rate, turns, KL, grad norm, entropy, step time and
    sync time come first, in that order, whatever order the dict has; every other metric follows by name; a
    headline matched by several metrics (two validation sources) shows each under its full name."""
    headline = {"critic/score/mean": 0.5, "val-core/gsm8k/reward/mean@1": 0.25,
                "rollout/response_length/mean": 31.0, "rollout/tool/call_rate": 0.75,
                "rollout/turns/assistant_mean": 1.5, "actor/kl_loss": 0.002, "actor/grad_norm": 0.8,
                "actor/entropy": 2.1, "timing/step_s": 12.0, "timing/sync_weights_s": 0.4}
    rest = {"actor/lr": 1e-4, "actor/pg_loss": -0.1, "zeta/last": 1.0, "critic/advantages/max": 3.0}
    metrics = dict(reversed(list({**headline, **rest}.items())))
    assert console_line(metrics, 3) == (
        "step 3 | score=0.5 val_score=0.25 response_length=31 tool_call_rate=0.75 turns=1.5 kl=0.002 grad_norm=0.8 "
        "entropy=2.1 step_s=12 sync_s=0.4 | actor/lr=0.0001 actor/pg_loss=-0.1 critic/advantages/max=3 zeta/last=1")
    two_sources = {"val-core/b/reward/mean@1": 1.0, "val-core/a/reward/mean@1": 0.0, "timing/validation_s": 2.0}
    assert console_line(two_sources, 0) == \
        "step 0 | val-core/a/reward/mean@1=0 val-core/b/reward/mean@1=1 | timing/validation_s=2"


@pytest.mark.unit
def test_console_sink_logs_that_line_and_jsonl_keeps_every_metric(tmp_path, caplog):
    """Contract: `Tracking.log` sends `console_line` to the console logger, and metrics.jsonl holds every metric."""
    tracker = Tracking(["console"], "p", "e", tmp_path)
    with caplog.at_level(logging.INFO, logger="recipe.tracking"):
        tracker.log({"actor/lr": 1e-4, "critic/score/mean": 1.0}, 1)
    tracker.finish()
    assert [r.getMessage() for r in caplog.records] == ["step 1 | score=1 | actor/lr=0.0001"]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "actor/lr": 1e-4,
                                                                      "critic/score/mean": 1.0}


@pytest.mark.unit
def test_fresh_run_sets_an_older_runs_records_aside_and_starts_anew(tmp_path):
    """Contract: a fresh run in a directory that holds an older run's metrics.jsonl and step dumps renames them
    to `<name>.<k>` (first free k, so a third run keeps both older ones) and never appends to them."""
    _write(tmp_path / "metrics.jsonl", [1, 2, 3])
    _write(tmp_path / "rollout" / "2.jsonl", [2])
    (tmp_path / "rollout" / "notes.txt").write_text("not a dump")
    tracker = Tracking([], "p", "e", tmp_path, dump_dirs=[tmp_path / "rollout", None, tmp_path / "absent"])
    tracker.log({"a": 1.0}, 1)
    tracker.finish()
    assert _steps(tmp_path / "metrics.jsonl") == [1]
    assert _steps(tmp_path / "metrics.jsonl.1") == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir()) == ["2.jsonl.1", "notes.txt"]
    Tracking([], "p", "e", tmp_path).finish()
    assert _steps(tmp_path / "metrics.jsonl.1") == [1, 2, 3] and _steps(tmp_path / "metrics.jsonl.2") == [1]
    assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.unit
def test_resume_drops_the_records_after_the_resumed_step_so_each_step_appears_once(tmp_path):
    """Contract (issue 17): the killed run logged steps 1-3 (and validated at 0 and 2) but its last complete
    checkpoint is step 1; resumed from it, metrics.jsonl and the step dumps keep what came up to step 1, drop
    the rest, and the resumed run's steps 2-3 then appear once each."""
    _write(tmp_path / "metrics.jsonl", [0, 1, 2, 2, 3])
    for step in (1, 2, 3):
        _write(tmp_path / "rollout" / f"{step}.jsonl", [step])
    for step in (0, 2):
        _write(tmp_path / "val" / f"{step}.jsonl", [step])
    tracker = Tracking([], "p", "e", tmp_path, resume_step=1, dump_dirs=[tmp_path / "rollout", tmp_path / "val"])
    assert _steps(tmp_path / "metrics.jsonl") == [0, 1]
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir()) == ["1.jsonl"]
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl"]
    for step in (2, 3):
        tracker.log({"x": float(step)}, step)
    tracker.finish()
    assert _steps(tmp_path / "metrics.jsonl") == [0, 1, 2, 3]
    assert not list(tmp_path.glob("metrics.jsonl.*")) and not list(tmp_path.glob(".metrics*"))


@pytest.mark.unit
def test_tensorboard_without_its_package_is_one_line_naming_the_install(monkeypatch):
    """Contract: trainer.logger with tensorboard when the `tensorboard` package is missing is refused by the config
    (before Ray) in one line naming trainer.logger and `pip install tensorboard`."""
    import importlib.util

    from recipe.config_shared import ConfigError, RunConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as refused:
        RunConfig(logger=["console", "tensorboard"])
    said = str(refused.value)
    assert said.startswith("trainer.logger=['console', 'tensorboard'] includes tensorboard") and "\n" not in said
    assert "pip install tensorboard" in said
    RunConfig(logger=["console"])  # no tensorboard asked: nothing to install


@pytest.mark.unit
def test_tensorboard_sink_writes_each_steps_scalars(tmp_path, monkeypatch):
    """Contract: with trainer.logger=[tensorboard], `Tracking.log` writes every metric as a scalar at its step into
    $TENSORBOARD_DIR (verl's variable), else <out_dir>/tensorboard; readable by tensorboard's own reader."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
        events = EventAccumulator(str(directory))
        events.Reload()
        return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    tracker = Tracking(["tensorboard"], "p", "e", tmp_path / "run")
    tracker.log({"critic/score/mean": 0.5, "actor/lr": 1e-3}, step=1)
    tracker.log({"critic/score/mean": 0.75}, step=2)
    tracker.finish()
    assert scalars(tmp_path / "run" / "tensorboard") == {"critic/score/mean": [(1, 0.5), (2, 0.75)],
                                                         "actor/lr": [(1, pytest.approx(1e-3))]}
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    tracker = Tracking(["console", "tensorboard"], "p", "e", tmp_path / "run2")
    tracker.log({"x": 2.0}, step=7)
    tracker.finish()
    assert scalars(tmp_path / "tb") == {"x": [(7, 2.0)]}
