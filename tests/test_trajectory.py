"""Unit tests of the trajectory record (rollout -> recipe contract) and its collation (recipe.batch)."""
from __future__ import annotations

import json

import pytest
import torch

from recipe.batch import collate
from rollout.trajectory import FinishReason, ToolCallRecord, Trajectory, TrajectoryStatus, TurnScore

pytestmark = pytest.mark.unit


def _traj(uid: str = "p0/0", prompt: list[int] | None = None) -> Trajectory:
    return Trajectory(uid=uid, prompt_uid=uid.split("/")[0], sample_index=0, prompt_ids=prompt or [5, 6, 7])


def _multi_turn() -> Trajectory:
    t = _traj()
    t.set_status(TrajectoryStatus.GENERATING)
    t.append_assistant([10, 11, 12], [-0.1, -0.2, -0.3], weight_version=3)
    t.set_status(TrajectoryStatus.TOOL_CALLING)
    t.tool_calls.append(ToolCallRecord(turn=0, name="calc", arguments={"x": 1}, raw="<tool_call>..", result="2",
                                       step_reward=0.5, latency_s=0.01, metrics={"ok": True}))
    t.append_context([20, 21], role="tool")
    t.set_status(TrajectoryStatus.GENERATING)
    t.append_assistant([13], [-0.4], weight_version=4)
    t.set_status(TrajectoryStatus.INTERACTING)
    t.interaction_scores.append(TurnScore(turn=1, score=1.0))
    t.append_context([22], role="user")
    t.num_user_turns = 1
    t.set_status(TrajectoryStatus.GENERATING)
    t.append_assistant([14, 15], [-0.5, -0.6], weight_version=4)
    t.messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    t.data_source, t.ground_truth, t.extra_info = "openai/gsm8k", "72", {"index": 3}
    t.finish(FinishReason.STOP)
    return t


def test_mask_and_logprobs_follow_appends():
    """Contract: the mask is 1 exactly on engine-appended ids and log-probs are 0 on inserted ids."""
    t = _multi_turn()
    assert t.response_ids == [10, 11, 12, 20, 21, 13, 22, 14, 15]
    assert t.response_mask == [1, 1, 1, 0, 0, 1, 0, 1, 1]
    assert t.rollout_logprobs == pytest.approx([-0.1, -0.2, -0.3, 0, 0, -0.4, 0, -0.5, -0.6])
    assert [(s.role, s.start, s.end) for s in t.turns] == [
        ("assistant", 0, 3), ("tool", 3, 5), ("assistant", 5, 6), ("user", 6, 7), ("assistant", 7, 9)
    ]
    assert t.weight_versions == [3, 4, 4]
    assert t.num_assistant_turns == 3
    assert t.tool_reward == pytest.approx(0.5)
    t.check_invariants()


def test_append_refuses_mismatched_logprobs_and_policy_context():
    """Contract: an engine result with fewer log-probs than ids, or context appended as 'assistant', is refused."""
    t = _traj()
    with pytest.raises(ValueError, match="log-probs"):
        t.append_assistant([1, 2], [-0.1], weight_version=0)
    with pytest.raises(ValueError, match="append_assistant"):
        t.append_context([1], role="assistant")
    assert t.response_ids == [] and t.response_mask == []


def test_status_machine_refuses_illegal_moves():
    """Contract: status moves only along pending -> generating -> tool_calling/interacting -> done."""
    t = _traj()
    with pytest.raises(ValueError, match="pending -> tool_calling"):
        t.set_status(TrajectoryStatus.TOOL_CALLING)
    t.finish(FinishReason.LENGTH)
    with pytest.raises(ValueError, match="done -> generating"):
        t.set_status(TrajectoryStatus.GENERATING)
    t.finish(FinishReason.STOP)  # the first finish reason wins
    assert t.finish_reason is FinishReason.LENGTH


def test_check_invariants_catches_tampering():
    """Contract: a record whose mask disagrees with its turn roles is detected, not trained on."""
    t = _multi_turn()
    t.response_mask[3] = 1  # a tool token marked as sampled
    with pytest.raises(ValueError, match="tool turn"):
        t.check_invariants()
    t = _multi_turn()
    t.rollout_logprobs.pop()
    with pytest.raises(ValueError, match="same length"):
        t.check_invariants()


def test_round_trip_through_json():
    """Contract: to_dict -> JSON -> from_dict gives an equal record (slime's test_sample style)."""
    t = _multi_turn()
    t.drift_index = 7
    t.generation_time_s = 1.5
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    assert back.status is TrajectoryStatus.DONE and back.finish_reason is FinishReason.STOP
    assert isinstance(back.turns[0], type(t.turns[0])) and isinstance(back.tool_calls[0], ToolCallRecord)
    assert back.interaction_scores == [TurnScore(1, 1.0)] and back.data_source == "openai/gsm8k"
    fresh = _traj()
    assert Trajectory.from_dict(fresh.to_dict()) == fresh


def test_collate_pads_prompt_left_response_right():
    """Contract: prompts end at one column, responses start right after, masks and positions line up."""
    a = _multi_turn()  # prompt 3, response 9
    b = _traj("p1/0", prompt=[1, 2, 3, 4, 5])
    b.set_status(TrajectoryStatus.GENERATING)
    b.append_assistant([30, 31], [-1.0, -2.0], weight_version=0)
    b.finish(FinishReason.LENGTH)
    out = collate([a, b], pad_token_id=0)
    assert out["prompts"].shape == (2, 5) and out["responses"].shape == (2, 9)
    assert out["prompts"][0].tolist() == [0, 0, 5, 6, 7]
    assert out["responses"][1].tolist() == [30, 31] + [0] * 7
    assert out["input_ids"].shape == (2, 14)
    assert out["attention_mask"][0].tolist() == [0, 0] + [1] * 12
    assert out["attention_mask"][1].tolist() == [1] * 7 + [0] * 7
    assert out["response_mask"][0].tolist() == a.response_mask
    assert out["response_mask"][1].tolist() == [1, 1] + [0] * 7
    assert out["rollout_logprobs"][1, :2].tolist() == [-1.0, -2.0]
    # positions count real tokens: 0.. on the first real token, whatever the left padding
    assert out["position_ids"][0, 2:].tolist() == list(range(12))
    assert out["position_ids"][1, :7].tolist() == list(range(7))
    assert out["input_ids"].dtype == torch.long and out["rollout_logprobs"].dtype == torch.float32


def test_collate_fixed_lengths_and_refusals():
    """Contract: fixed max lengths pad to that width; a longer trajectory or an empty batch is refused."""
    t = _multi_turn()
    out = collate([t], pad_token_id=9, max_prompt_length=4, max_response_length=12)
    assert out["prompts"].shape == (1, 4) and out["responses"].shape == (1, 12)
    with pytest.raises(ValueError, match="max_response_length 4"):
        collate([t], pad_token_id=0, max_response_length=4)
    with pytest.raises(ValueError, match="empty batch"):
        collate([], pad_token_id=0)


def test_assistant_turn_ends_locate_turn_indexed_rewards():
    """Contract: turn k's recorded rewards belong on `assistant_turn_ends[k]`, the last token of assistant turn k
    (a sampled token), whatever tool and user turns lie in between."""
    t = _multi_turn()
    assert t.assistant_turn_ends == [2, 5, 8]
    assert all(t.response_mask[i] == 1 for i in t.assistant_turn_ends)
    assert t.assistant_turn_ends[t.tool_calls[0].turn] == 2 and t.assistant_turn_ends[t.interaction_scores[0].turn] == 5
