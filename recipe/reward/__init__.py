"""Outcome rewards: one score per trajectory, picked by the data row's `data_source`.

`score_trajectory` reads the policy's own text (assistant messages only) and the row's
ground truth and asks the task's scorer. Tool step rewards and interaction scores are
recorded by the rollout; `recipe.trainer` places all three on the token axis
(`recipe.algos.place_token_rewards`), each with its own weight.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from recipe.reward import gsm8k

Scorer = Callable[[str, Any], float]

SCORERS: dict[str, Scorer] = {source: gsm8k.compute_score for source in gsm8k.DATA_SOURCES}


def policy_text(messages: list[dict[str, Any]]) -> str:
    """The assistant messages of a chat, joined by newlines (what the policy wrote)."""
    return "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "assistant")


def score_trajectory(data_source: str, messages: list[dict[str, Any]], ground_truth: Any) -> float:
    """Outcome score of one trajectory with the scorer registered for `data_source`."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise ValueError(f"no outcome scorer for data_source {data_source!r}; known: {sorted(SCORERS)} "
                         "(register one in recipe.reward.SCORERS)")
    return float(scorer(policy_text(messages), ground_truth))
