"""Rewards of a batch of trajectories: outcome scores, tool and interaction rewards, their weighted sum on tokens.

A trajectory earns four kinds of reward, each weighted by `reward.*`:
- outcome: `compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)`
  on the text the policy wrote (its assistant messages). The function is verl's
  `custom_reward_function.{path,name}` when set, else the scorer of the task that declares the
  row's data source (`task_compute_score`: a module of `recipe.tasks`). Both load through the one
  plug-in loader (`rollout.plugins.import_object`). It returns a float, or a dict with "score" whose
  other keys become `reward/extra/<key>/mean` metrics; placed on the last sampled token.
- tool step rewards: each call's reward from `execute`, on the last token of the assistant turn
  that made the call (`ToolCallRecord.turn`).
- tool final rewards: each tool instance's `calc_reward`, on the last sampled token.
- interaction scores: each `generate_response` score, on the last token of the assistant turn
  it graded (`TurnScore.turn`). verl's interactions compute it with their own `calculate_score`
  inside `generate_response`, which is where verl calls it; polyturn records that score with its
  turn and calls nothing again here (the instance is finalized by the end of the rollout).

Every position comes from the turn index recorded on the trajectory when the reward was
produced; nothing is re-derived here.

Where it departs from verl's reward managers: the outcome is scored on the policy's own text,
never on tool responses or user turns, which may quote an answer (the gsm8k tool echoes it).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from recipe.algos import place_token_rewards
from recipe.tasks import missing_scorer_problems, scorer_of, scorer_paths
from rollout.plugins import PluginConfigError, import_object
from rollout.trajectory import Trajectory

ComputeScore = Callable[..., "float | dict[str, Any]"]  # (data_source, solution_str, ground_truth, extra_info, **kw)


@dataclass
class RewardConfig:
    """`reward.*`: weights of the reward kinds a trajectory earns."""

    outcome_weight: float = 1.0
    """The outcome score (data source's scorer or custom_reward_function), on the last sampled token."""
    tool_weight: float = 1.0
    """Each tool call's step reward, on the last token of the assistant turn that made the call."""
    tool_final_weight: float = 0.0
    """Each tool's final calc_reward (e.g. the best gsm8k score), on the last sampled token."""
    interaction_weight: float = 0.0
    """Each interaction score, on the last token of the assistant turn it graded."""


@dataclass
class CustomRewardFunctionConfig:
    """`custom_reward_function.*` (verl's keys): the outcome scorer from a Python file instead of the registry."""

    path: str | None = None
    """Python file defining the function; None: the scorer of the task (recipe/tasks/) declaring each row's
    data_source."""
    name: str = "compute_score"
    """Function in that file: `compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)`
    returning a float or a dict with "score" (its other keys become `reward/extra/*` metrics)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the scorer, custom or built-in (e.g. {method: flexible} for gsm8k)."""

    def __post_init__(self) -> None:
        if not isinstance(self.reward_kwargs, dict):
            raise ValueError(f"custom_reward_function.reward_kwargs is {self.reward_kwargs!r}; give a mapping, "
                             "e.g. custom_reward_function.reward_kwargs={method: flexible}")


def task_compute_score() -> ComputeScore:
    """verl's `default_compute_score` role: each row scored by the task that declares its data source
    (`recipe.tasks`), called as `compute_score(solution_str, ground_truth, **reward_kwargs)`."""
    paths = scorer_paths()
    scorers = {path: import_object(path, f"the scorer of data_source {source!r}") for source, path in paths.items()}

    def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                      **reward_kwargs: Any) -> float | dict[str, Any]:
        path = scorer_of(data_source, paths)
        if path is None:
            raise ValueError(missing_scorer_problems([data_source], paths, "of a trajectory")[0])
        return scorers[path](solution_str, ground_truth, **reward_kwargs)

    return compute_score


def load_compute_score(cfg: CustomRewardFunctionConfig) -> ComputeScore:
    """The outcome function `cfg` names (with its reward_kwargs bound), or the tasks' (`task_compute_score`)."""
    fn: ComputeScore = task_compute_score()
    if cfg.path is not None:
        where = f"custom_reward_function.name={cfg.name!r}"
        try:
            fn = import_object(f"{cfg.path}:{cfg.name}", where)
        except PluginConfigError as err:
            raise ValueError(str(err)) from None
        if not callable(fn):
            raise ValueError(f"{where}: not a function; name the function that computes the score")
    return functools.partial(fn, **cfg.reward_kwargs) if cfg.reward_kwargs else fn


def policy_text(messages: list[dict[str, Any]]) -> str:
    """The assistant messages of a chat, joined by newlines (what the policy wrote)."""
    return "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "assistant")


@dataclass
class RewardTerms:
    """Per-sample rewards of a batch, before weighting and placement on the token axis."""

    outcome: Tensor  # (B,) outcome score
    tool_final: Tensor  # (B,) sum over the sample's tools of their final calc_reward
    tool: list[list[tuple[int, float]]]  # per sample: (response index of the calling turn's last token, step reward)
    interaction: list[list[tuple[int, float]]]  # per sample: (response index of the graded turn's last token, score)
    extra: dict[str, list[float]]  # extra keys of dict-valued outcome scores, per sample (NaN where absent)

    def totals(self, w: RewardConfig) -> Tensor:
        """(B,) each sample's weighted total reward (the sum its token rewards add up to)."""
        steps = [(w.tool_weight * sum(r for _, r in t) + w.interaction_weight * sum(r for _, r in i))
                 for t, i in zip(self.tool, self.interaction)]
        return (w.outcome_weight * self.outcome + w.tool_final_weight * self.tool_final
                + torch.tensor(steps, dtype=torch.float32))

    def metrics(self) -> dict[str, float]:
        """Per-sample means of the summed tool step rewards and interaction scores, and of each extra key."""
        b = max(len(self.tool), 1)
        m = {"reward/tool_mean": sum(r for steps in self.tool for _, r in steps) / b,
             "reward/interaction_mean": sum(r for steps in self.interaction for _, r in steps) / b}
        for key, values in self.extra.items():
            present = [v for v in values if not math.isnan(v)]
            if present:
                m[f"reward/extra/{key}/mean"] = sum(present) / len(present)
        return m


class RewardFn:
    """Scores trajectories and places the weighted rewards on the token axis."""

    def __init__(self, weights: RewardConfig, custom: CustomRewardFunctionConfig):
        self.weights = weights
        self.compute_score = load_compute_score(custom)

    def outcome(self, t: Trajectory) -> tuple[float, dict[str, float]]:
        """(score, extra values) of one trajectory's final answer."""
        result = self.compute_score(t.data_source, policy_text(t.messages), t.ground_truth, t.extra_info)
        extra: dict[str, float] = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(f"the reward function returned {sorted(result)} for {t.uid}; a dict result needs "
                                 "a 'score' key")
            extra = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, (int, float))}
            result = result["score"]
        return float(result), extra

    def terms(self, trajs: list[Trajectory]) -> RewardTerms:
        """Every reward of every trajectory, located by the turn indices the rollout recorded."""
        outcome, tool_final, tool, interaction, extras = [], [], [], [], []
        for t in trajs:
            score, extra = self.outcome(t)
            outcome.append(score)
            extras.append(extra)
            tool_final.append(sum(t.tool_rewards.values()))
            ends = t.assistant_turn_ends
            tool.append([(ends[c.turn], c.step_reward) for c in t.tool_calls if c.step_reward])
            interaction.append([(ends[s.turn], s.score) for s in t.interaction_scores])
        keys = sorted({k for e in extras for k in e})
        return RewardTerms(torch.tensor(outcome, dtype=torch.float32), torch.tensor(tool_final, dtype=torch.float32),
                           tool, interaction, {k: [e.get(k, math.nan) for e in extras] for k in keys})

    def token_rewards(self, terms: RewardTerms, response_mask: Tensor) -> Tensor:
        """(B, T) weighted rewards on sampled tokens (`response_mask` (B, T) of the same trajectories)."""
        w = self.weights
        final = w.outcome_weight * terms.outcome + w.tool_final_weight * terms.tool_final  # (B,)
        return place_token_rewards(response_mask, final, terms.tool, terms.interaction,
                                   tool_weight=w.tool_weight, interaction_weight=w.interaction_weight)
