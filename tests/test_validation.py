"""Validation metrics under verl's names, and the per-step trajectory JSONL (recipe.validation), on hand-built
trajectories: no engine, no Ray."""
from __future__ import annotations

import json

import pytest
import torch

from recipe.reward import RewardTerms
from recipe.validation import trajectory_records, val_metrics, write_jsonl
from rollout.trajectory import FinishReason, ToolCallRecord, Trajectory, TurnSpan


def traj(prompt_uid: str, k: int, source: str, *, calls: int = 0, turns: int = 1) -> Trajectory:
    t = Trajectory(uid=f"{prompt_uid}/{k}", prompt_uid=prompt_uid, sample_index=k, prompt_ids=[1, 2],
                   response_ids=[5] * (2 * turns), response_mask=[1] * (2 * turns), data_source=source,
                   ground_truth="42", messages=[{"role": "user", "content": "q?"}])
    t.turns = [TurnSpan("assistant", 2 * i, 2 * i + 2) for i in range(turns)]
    for i in range(turns):
        t.messages.append({"role": "assistant", "content": f"a{i}"})
    t.tool_calls = [ToolCallRecord(turn=0, name="calc", arguments={"x": 1}, raw='{"x": 1}', result="1",
                                   step_reward=0.1) for _ in range(calls)]
    t.finish(FinishReason.STOP)
    return t


@pytest.mark.unit
def test_val_metrics_per_data_source_with_verl_names():
    """Contract: mean@n / std@n / best@n / worst@n per data source, extra keys, tool-call rate and turn count."""
    trajs = [traj("p0", 0, "gsm8k", calls=1, turns=2), traj("p0", 1, "gsm8k"),
             traj("p1", 0, "gsm8k", calls=2, turns=2), traj("p1", 1, "gsm8k"),
             traj("q0", 0, "math"), traj("q0", 1, "math")]
    rewards = [1.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    m = val_metrics(trajs, rewards, n=2, extra={"acc": [1.0, 0.0, 0.0, 0.0, float("nan"), float("nan")]})
    assert m["val-core/gsm8k/reward/mean@2"] == pytest.approx(0.25)
    assert m["val-core/math/reward/mean@2"] == pytest.approx(0.5)
    assert m["val-aux/gsm8k/reward/std@2"] == pytest.approx(0.4330127, rel=1e-6)
    assert m["val-aux/gsm8k/reward/best@2/mean"] == pytest.approx(0.5)  # p0 best 1, p1 best 0
    assert m["val-aux/gsm8k/reward/worst@2/mean"] == pytest.approx(0.0)
    assert m["val-aux/gsm8k/acc/mean@2"] == pytest.approx(0.25) and "val-aux/math/acc/mean@2" not in m
    assert m["val-aux/gsm8k/tool_call_rate"] == pytest.approx(0.5) and m["val-aux/math/tool_call_rate"] == 0.0
    assert m["val-aux/gsm8k/num_turns/mean"] == pytest.approx(1.5)


@pytest.mark.unit
def test_trajectory_jsonl_has_prompt_response_tool_calls_rewards_finish_reason(tmp_path):
    """Contract: `<dir>/<step>.jsonl`, one line per trajectory with the fields the issue names, readable as JSON."""
    from tests.test_colocate import FakeTokenizer

    trajs = [traj("p0", 0, "gsm8k", calls=1, turns=2), traj("p0", 1, "gsm8k")]
    trajs[1].finish_reason = FinishReason.LENGTH
    trajs[0].traces = [{"name": "Tool.execute", "args": ["i", {"x": 1}], "kwargs": {}, "result": "1", "duration_s": 0.1}]
    terms = RewardTerms(outcome=torch.tensor([1.0, 0.0]), tool_final=torch.tensor([0.0, 0.0]),
                        tool=[[(1, 0.1)], []], interaction=[[], []], extra={})
    path = write_jsonl(tmp_path / "rollout", 3, trajectory_records(trajs, terms, [1.1, 0.0], 3, FakeTokenizer()))
    assert path == tmp_path / "rollout" / "3.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2
    first = rows[0]
    assert first["step"] == 3 and first["uid"] == "p0/0" and first["data_source"] == "gsm8k"
    assert first["prompt"] == [{"role": "user", "content": "q?"}] and first["response"] == "a0\na1"
    assert first["tool_calls"] == [{"turn": 0, "name": "calc", "arguments": {"x": 1}, "raw": '{"x": 1}', "result": "1",
                                    "error": None, "step_reward": 0.1}]
    assert first["rewards"] == {"total": 1.1, "outcome": 1.0, "tool_final": 0.0, "tool_steps": [0.1], "interaction": []}
    assert first["finish_reason"] == "stop" and rows[1]["finish_reason"] == "length" and rows[1]["tool_calls"] == []
    assert first["response_ids"] == [5, 5, 5, 5] and first["response_mask"] == [1, 1, 1, 1]
    assert [(s["role"], s["start"], s["end"], s["text"]) for s in first["turns"]] == \
        [("assistant", 0, 2, "<5><5>"), ("assistant", 2, 4, "<5><5>")]
    assert first["tokenizer"] == "fake/tokenizer"
    assert first["traces"] == trajs[0].traces and rows[1]["traces"] == []  # rollout_trace_op records


@pytest.mark.unit
def test_fit_validates_before_training_every_test_freq_and_after_the_last_step(tmp_path):
    """Contract: with val_before_train, test_freq=2 and 3 steps, fit validates at steps 0, 2 and 3 through the
    validator (greedy by default), logs val-core metrics and writes validation and rollout JSONL per step."""
    from recipe.reward import RewardFn
    from recipe.validation import Validator
    from tests.test_colocate import FakeAgentLoop, make_trainer, prompts

    val = tmp_path / "val.parquet"
    val.write_bytes(b"")  # validation only checks that the file exists
    trainer, _ = make_trainer(tmp_path, [
        f"data.val_files=[{val}]", "trainer.test_freq=2", "trainer.val_before_train=true",
        "trainer.total_training_steps=3", f"trainer.validation_data_dir={tmp_path / 'val'}",
        f"trainer.rollout_data_dir={tmp_path / 'rollout'}", "trainer.log_val_generations=1"], colocated=False)
    logged, tables = [], []
    trainer.tracker.log = lambda metrics, step: logged.append((step, metrics))
    trainer.tracker.log_table = lambda name, columns, rows, step: tables.append((name, step, len(rows)))
    cfg = trainer.cfg
    trainer.validator = Validator(["v0", "v1"], FakeAgentLoop([], n=1), cfg.actor_rollout_ref.rollout.val_kwargs,
                                  RewardFn(cfg.reward, cfg.custom_reward_function), log_generations=1)
    trainer.fit(iter([prompts(), prompts(), prompts()]))
    val_steps = [step for step, m in logged if "val-core/openai/gsm8k/reward/mean@1" in m]
    assert val_steps == [0, 2, 3]
    assert all(m["val-core/openai/gsm8k/reward/mean@1"] == 1.0 for step, m in logged if step in val_steps and
               "timing/validation_s" in m)
    assert [t for t in tables if t[0] == "val/generations"] == [("val/generations", s, 1) for s in (0, 2, 3)]
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl", "2.jsonl", "3.jsonl"]
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl"]
    train_metrics = [m for _, m in logged if "rollout/num_trajectories" in m]
    assert len(train_metrics) == 3 and all(m["perf/time_per_step"] > 0 and "perf/throughput" in m for m in train_metrics)
