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
    trajs = [traj("p0", 0, "gsm8k", calls=1, turns=2), traj("p0", 1, "gsm8k")]
    trajs[1].finish_reason = FinishReason.LENGTH
    terms = RewardTerms(outcome=torch.tensor([1.0, 0.0]), tool_final=torch.tensor([0.0, 0.0]),
                        tool=[[(1, 0.1)], []], interaction=[[], []], extra={})
    path = write_jsonl(tmp_path / "rollout", 3, trajectory_records(trajs, terms, [1.1, 0.0], step=3))
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
