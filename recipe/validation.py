"""Validation and trajectory records: held-out prompts rolled out and scored, nothing trained on them.

`Validator.run` rolls the validation prompts out through the training `AgentLoop`'s own engines,
tools and interactions, with `actor_rollout_ref.rollout.val_kwargs` sampling (greedy, one sample
per prompt, unless `do_sample`), scores them with `recipe.reward` exactly as training samples are
scored, and returns `val_metrics`. `trajectory_records` + `write_jsonl` write one JSONL file per
step (`trainer.rollout_data_dir`, `trainer.validation_data_dir`): each trajectory's messages, rewards and
tool calls, and its token ids, mask, engine log-probs, weight versions and turn spans with their text
(`python -m recipe.show_trajectory` prints one).

Metric names follow verl's `val-core/<data_source>/reward/mean@<n>` (the weighted total reward);
`val-aux/<data_source>/reward/{std,best,worst}@<n>` and the dict-score extra keys
(`val-aux/<data_source>/<key>/mean@<n>`) go under val-aux as in verl. Where it departs from verl:
best@n / worst@n are the exact max / min over each prompt's n samples (verl bootstraps them), and
there are multi-turn metrics of our own: `val-aux/<data_source>/tool_call_rate` (share of samples
that made at least one tool call) and `val-aux/<data_source>/num_turns/mean` (assistant turns).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from recipe.reward import RewardFn, RewardTerms, policy_text
from rollout.agent_loop import AgentLoop
from rollout.config import ValKwargsConfig
from rollout.prompt import RolloutPrompt
from rollout.trajectory import Trajectory

TABLE_COLUMNS = ["uid", "data_source", "prompt", "response", "ground_truth", "reward", "finish_reason"]


def val_metrics(trajs: list[Trajectory], rewards: list[float], n: int,
                extra: dict[str, list[float]] | None = None) -> dict[str, float]:
    """verl-named validation metrics per data source; `rewards[i]` is trajectory i's total reward, `extra[k][i]` its
    dict-score extra value `k` (NaN where absent)."""
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        by_source[t.data_source or "unknown"].append(i)
    m: dict[str, float] = {}
    for source, rows in sorted(by_source.items()):
        values = [rewards[i] for i in rows]
        mean = sum(values) / len(values)
        m[f"val-core/{source}/reward/mean@{n}"] = mean
        m[f"val-aux/{source}/reward/std@{n}"] = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        groups: dict[str, list[float]] = defaultdict(list)
        for i in rows:
            groups[trajs[i].prompt_uid].append(rewards[i])
        m[f"val-aux/{source}/reward/best@{n}/mean"] = sum(max(g) for g in groups.values()) / len(groups)
        m[f"val-aux/{source}/reward/worst@{n}/mean"] = sum(min(g) for g in groups.values()) / len(groups)
        for key, per_sample in (extra or {}).items():
            present = [per_sample[i] for i in rows if not math.isnan(per_sample[i])]
            if present:
                m[f"val-aux/{source}/{key}/mean@{n}"] = sum(present) / len(present)
        m[f"val-aux/{source}/tool_call_rate"] = sum(bool(trajs[i].tool_calls) for i in rows) / len(rows)
        m[f"val-aux/{source}/num_turns/mean"] = sum(trajs[i].num_assistant_turns for i in rows) / len(rows)
    return m


def trajectory_records(trajs: list[Trajectory], terms: RewardTerms, rewards: list[float], step: int,
                       tokenizer: Any) -> list[dict[str, Any]]:
    """One JSON-ready dict per trajectory: prompt messages, response (what the policy wrote), the whole chat after
    the prompt, tool calls, rewards and finish reason; and what was trained on, as the engine produced it: the
    token ids, the response mask, the engine's log-probs, each assistant turn's weight version, and the turn spans
    with their text (`tokenizer` decodes them; its `name_or_path` is recorded for `recipe.show_trajectory`)."""
    records = []
    for i, t in enumerate(trajs):
        first = next((k for k, msg in enumerate(t.messages) if msg.get("role") == "assistant"), len(t.messages))
        records.append({
            "step": step, "uid": t.uid, "data_source": t.data_source, "ground_truth": t.ground_truth,
            "prompt": t.messages[:first], "response": policy_text(t.messages), "messages": t.messages[first:],
            "tool_calls": [{"turn": c.turn, "name": c.name, "arguments": c.arguments, "raw": c.raw, "result": c.result,
                            "error": c.error, "step_reward": c.step_reward} for c in t.tool_calls],
            "rewards": {"total": rewards[i], "outcome": float(terms.outcome[i]),
                        "tool_final": float(terms.tool_final[i]), "tool_steps": [r for _, r in terms.tool[i]],
                        "interaction": [r for _, r in terms.interaction[i]]},
            "finish_reason": t.finish_reason.value if t.finish_reason else None,
            "num_turns": t.num_assistant_turns, "response_tokens": len(t.response_ids),
            "tokenizer": tokenizer.name_or_path, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
            "response_mask": t.response_mask, "rollout_logprobs": t.rollout_logprobs,
            "weight_versions": t.weight_versions,
            "turns": [{"role": s.role, "start": s.start, "end": s.end, "weight_version": s.weight_version,
                       "text": tokenizer.decode(t.response_ids[s.start:s.end], skip_special_tokens=False)}
                      for s in t.turns],
            "traces": t.traces,  # the rollout_trace_op calls of its tools and interactions (rollout.tracing)
        })
    return records


def write_jsonl(directory: str | Path, step: int, records: list[dict[str, Any]]) -> Path:
    """`<directory>/<step>.jsonl`, one record a line (values JSON cannot hold are written as strings)."""
    path = Path(directory) / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")
    return path


def validation_loop(agent_loop: AgentLoop, tokenizer: Any, val_kwargs: ValKwargsConfig) -> AgentLoop:
    """An agent loop on the training loop's engines, tools and interactions, sampling with `val_kwargs`."""
    cfg = dataclasses.replace(agent_loop.config, n=val_kwargs.n, temperature=val_kwargs.temperature,
                              top_p=val_kwargs.top_p, top_k=val_kwargs.top_k)
    return AgentLoop(agent_loop.router, tokenizer, cfg, tools=agent_loop.tools, interactions=agent_loop.interactions,
                     chat_template_kwargs=agent_loop.codec.template_kwargs)


@dataclasses.dataclass
class ValResult:
    """One validation: its metrics, the first `log_generations` samples as table rows, the JSONL records."""

    metrics: dict[str, float]
    table: list[list[Any]]
    records: list[dict[str, Any]]


class Validator:
    """Rolls out and scores the validation prompts (all of them, every time)."""

    def __init__(self, prompts: list[RolloutPrompt], agent_loop: AgentLoop, val_kwargs: ValKwargsConfig,
                 reward_fn: RewardFn, log_generations: int = 0, seed: int | None = None):
        self.prompts = prompts
        self.seed = seed  # the same at every validation: each one samples with the same noise
        self.agent_loop = agent_loop
        self.greedy = not val_kwargs.do_sample
        self.n = 1 if self.greedy else val_kwargs.n
        self.reward_fn = reward_fn
        self.log_generations = log_generations

    async def run(self, step: int) -> ValResult:
        """Validate once; `step` is the training step it follows (0: before training)."""
        trajs = await self.agent_loop.generate(self.prompts, greedy=self.greedy, seed=self.seed)
        terms = self.reward_fn.terms(trajs)
        rewards = [float(r) for r in terms.totals(self.reward_fn.weights)]
        records = trajectory_records(trajs, terms, rewards, step, self.agent_loop.codec.tokenizer)
        table = [[r["uid"], r["data_source"], json.dumps(r["prompt"])[-500:], r["response"][-500:],
                  str(r["ground_truth"]), r["rewards"]["total"], r["finish_reason"]]
                 for r in records[: self.log_generations]]
        return ValResult(val_metrics(trajs, rewards, self.n, terms.extra), table, records)
