"""The rollout's metrics: `rollout/*` and `timing/rollout_*`, computed from finished trajectories alone.

Finish reasons, turns, lengths, sampled tokens, time spent on the engine / tools / simulated users,
tool calls and their errors, tool rewards, interaction scores and template drift, all read off the
`Trajectory` records, so any schedule (one rollout per step, or groups streamed in) logs the same
keys for the trajectories it trains on.
"""
from __future__ import annotations

from collections import Counter

from rollout.trajectory import FinishReason, Trajectory


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """`rollout/*` and `timing/rollout_*` metrics of a rollout, computed from its trajectories alone."""
    m: dict[str, float] = {"rollout/num_trajectories": float(len(trajs))}
    reasons = Counter(t.finish_reason.value for t in trajs if t.finish_reason is not None)
    for r in FinishReason:
        m[f"rollout/finish/{r.value}"] = float(reasons.get(r.value, 0))
    n = max(len(trajs), 1)
    m["rollout/turns/assistant_mean"] = sum(t.num_assistant_turns for t in trajs) / n
    m["rollout/turns/assistant_max"] = float(max((t.num_assistant_turns for t in trajs), default=0))
    m["rollout/turns/user_mean"] = sum(t.num_user_turns for t in trajs) / n
    m["rollout/response_length/mean"] = sum(len(t.response_ids) for t in trajs) / n
    m["rollout/response_length/max"] = float(max((len(t.response_ids) for t in trajs), default=0))
    m["rollout/sampled_tokens"] = float(sum(sum(t.response_mask) for t in trajs))
    m["timing/rollout_generation_s"] = sum(t.generation_time_s for t in trajs)
    m["timing/rollout_tool_s"] = sum(t.tool_time_s for t in trajs)
    m["timing/rollout_interaction_s"] = sum(t.interaction_time_s for t in trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    m["rollout/tool/calls"] = float(len(calls))
    m["rollout/tool/call_rate"] = sum(bool(t.tool_calls) for t in trajs) / n  # share of samples with a call
    m["rollout/tool/truncations"] = float(sum(c.truncated for c in calls))
    per_tool = Counter(c.name for c in calls if c.name is not None)
    per_tool_errors = Counter(c.name for c in calls if c.name is not None and c.error is not None)
    for name in set(per_tool) | {name for t in trajs for name in t.tool_names}:
        m[f"rollout/tool/{name}/calls"] = float(per_tool.get(name, 0))
        m[f"rollout/tool/{name}/errors"] = float(per_tool_errors.get(name, 0))
    for kind, count in Counter(c.error for c in calls if c.error is not None).items():
        m[f"rollout/tool/errors/{kind}"] = float(count)
    m["rollout/tool/reward_mean"] = sum(t.tool_reward for t in trajs) / n
    scores = [s.score for t in trajs for s in t.interaction_scores]
    m["rollout/interaction/score_mean"] = sum(scores) / len(scores) if scores else 0.0
    drifted = [t.drift_index for t in trajs if t.drift_index is not None]
    m["rollout/drift/count"] = float(len(drifted))
    m["rollout/drift/first_index_min"] = float(min(drifted)) if drifted else -1.0
    return m
