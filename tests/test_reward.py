"""The reward module: verl's GSM8K scoring, the data-source registry, verl's custom_reward_function, and the
combination of outcome, tool and interaction rewards at the turns the rollout recorded."""
from __future__ import annotations

import math

import pytest
import torch

from recipe.batch import collate
import recipe.tasks
from recipe.reward import CustomRewardFunctionConfig, RewardConfig, RewardFn
from recipe.tasks.gsm8k import compute_score
from rollout.trajectory import ToolCallRecord, Trajectory, TurnScore

pytestmark = pytest.mark.unit


def test_gsm8k_default_is_verls_strict_scoring():
    """Contract: strict `#### N` by default; a format miss scores 0 (format_score only for a wrong found answer);
    only the last 300 characters count; flexible is opt-in; a non-numeric ground truth does not raise."""
    assert compute_score("so #### 72", "72") == 1.0
    assert compute_score("#### 72\nThat is my final answer, I am sure.", "72") == 1.0  # one more sentence is fine
    assert compute_score("the answer is 72", "72") == 0.0  # no ####: a format miss
    assert compute_score("the answer is 72", "72", method="flexible") == 1.0
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1 and compute_score("no answer", "72", format_score=0.1) == 0.0
    assert compute_score("#### 72" + "x" * 300, "72") == 0.0  # the answer lies before the last 300 characters
    assert compute_score("#### 1,200.", "1200") == 1.0 and compute_score("#### 72", "72", score=2.0) == 2.0
    assert compute_score("#### 72", "seventy-two") == 0.0 and compute_score("#### 72", None) == 0.0


def _traj(uid: str, source: str, answer: str, truth: str = "72") -> Trajectory:
    t = Trajectory(uid=uid, prompt_uid=uid.split("/")[0], sample_index=0, prompt_ids=[1, 2], data_source=source,
                   ground_truth=truth, extra_info={"index": 0})
    t.append_assistant([5, 6, 7], [0.0] * 3, 0)  # turn 0: calls a tool (tokens 0..2)
    t.append_context([8, 9], "tool")  # tokens 3..4
    t.append_assistant([10, 11], [0.0] * 2, 0)  # turn 1 (tokens 5..6), graded by the interaction
    t.append_context([12], "user")  # token 7
    t.append_assistant([13, 14], [0.0] * 2, 0)  # turn 2 (tokens 8..9), graded too
    t.tool_calls.append(ToolCallRecord(turn=0, name="calc", arguments={}, raw="", step_reward=-0.05))
    t.interaction_scores = [TurnScore(1, 0.0), TurnScore(2, 1.0)]
    t.tool_rewards = {"calc": 1.0}
    t.messages = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "#### 72"},
                  {"role": "assistant", "content": "#### 70"}, {"role": "user", "content": "again"},
                  {"role": "assistant", "content": answer}]
    return t


def test_rewards_sit_at_the_recorded_turns_with_their_weights():
    """Contract: the outcome (scored on the policy's own text, not the tool's echo) and the tool's final reward sit
    on the last sampled token, a tool step reward on the last token of the calling turn, each interaction score on
    the last token of the turn it graded, each scaled by its reward.* weight; the row sum equals `totals`."""
    w = RewardConfig(outcome_weight=2.0, tool_weight=1.0, tool_final_weight=0.5, interaction_weight=0.25)
    fn = RewardFn(w, CustomRewardFunctionConfig())
    trajs = [_traj("p/0", "openai/gsm8k", "#### 72"), _traj("p/1", "gsm8k", "I give up")]
    terms = fn.terms(trajs)
    assert terms.outcome.tolist() == [1.0, 0.0] and terms.tool_final.tolist() == [1.0, 1.0]
    assert terms.tool == [[(2, -0.05)]] * 2 and terms.interaction == [[(6, 0.0), (9, 1.0)]] * 2
    rewards = fn.token_rewards(terms, collate(trajs, pad_token_id=0)["response_mask"])  # (2, 10)
    assert rewards[0].tolist() == pytest.approx([0, 0, -0.05, 0, 0, 0, 0, 0, 0, 2.0 + 0.5 + 0.25])
    assert rewards[1, 9].item() == pytest.approx(0.5 + 0.25)
    assert torch.allclose(rewards.sum(dim=1), terms.totals(w))


def test_custom_reward_function_verl_signature(tmp_path):
    """Contract: custom_reward_function.{path,name} loads `compute_score(data_source, solution_str, ground_truth,
    extra_info, **reward_kwargs)`; a float or a dict with "score" works, extra dict keys become metrics."""
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info, bonus=0.0):\n"
        "    hit = float(ground_truth in solution_str)\n"
        "    return {'score': hit + bonus, 'length': len(solution_str), 'src_ok': float(data_source == 'mine')}\n")
    cfg = CustomRewardFunctionConfig(path=str(path), name="my_score", reward_kwargs={"bonus": 0.5})
    fn = RewardFn(RewardConfig(), cfg)
    terms = fn.terms([_traj("a/0", "mine", "72 it is"), _traj("b/0", "mine", "no")])
    assert terms.outcome.tolist() == [1.5, 0.5]
    metrics = terms.metrics()
    assert metrics["reward/extra/src_ok/mean"] == 1.0 and metrics["reward/extra/length/mean"] > 0
    with pytest.raises(ValueError, match="custom_reward_function.name='nope'"):
        RewardFn(RewardConfig(), CustomRewardFunctionConfig(path=str(path), name="nope"))


def test_scorer_is_the_task_declaring_the_data_source_and_takes_reward_kwargs(tmp_path, monkeypatch):
    """Contract: the outcome scorer is picked by the row's data_source from the task module that declares it (a new
    task is one new file in recipe/tasks/, no registry to edit); an unknown source is refused naming the fix;
    reward_kwargs reach the task's scorer (e.g. gsm8k's opt-in flexible extraction)."""
    (tmp_path / "suffix_task.py").write_text(
        'DATA_SOURCES = ("test/suffix",)\n\n\n'
        "def compute_score(solution_str, ground_truth, **kw):\n"
        "    return float(solution_str.endswith(ground_truth))\n")
    monkeypatch.setattr(recipe.tasks, "__path__", [*recipe.tasks.__path__, str(tmp_path)])
    fn = RewardFn(RewardConfig(), CustomRewardFunctionConfig())
    assert fn.outcome(_traj("a/0", "test/suffix", "ends with abc", truth="abc"))[0] == 1.0
    with pytest.raises(ValueError, match=r"data_source \['math500'\] of a trajectory has no outcome scorer.*custom_reward_function.path"):
        fn.outcome(_traj("a/0", "math500", "#### 72"))
    flexible = RewardFn(RewardConfig(), CustomRewardFunctionConfig(reward_kwargs={"method": "flexible"}))
    assert fn.outcome(_traj("a/0", "openai/gsm8k", "it is 72"))[0] == 0.0
    assert flexible.outcome(_traj("a/0", "openai/gsm8k", "it is 72"))[0] == 1.0
    assert math.isfinite(fn.terms([_traj("a/0", "openai/gsm8k", "#### 72")]).totals(RewardConfig())[0].item())
