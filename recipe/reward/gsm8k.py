"""GSM8K outcome scorer: the final `#### N` of the policy's own text against the ground truth.

The answer extraction and comparison are the rollout's (`rollout.tools.gsm8k_tool`), so the
tool, the interactions and this scorer can never disagree on what counts as correct.

Where it departs from verl's `gsm8k.compute_score`: a multi-turn trajectory is scored on the
text the policy sampled (its assistant messages, joined), never on tool responses or user
turns, which may quote numbers (the tool echoes the parsed answer); and numbers are compared
by value ("1,000" == "1000").
"""
from __future__ import annotations

from rollout.tools.gsm8k_tool import gsm8k_score

DATA_SOURCES = ("openai/gsm8k", "gsm8k")


def compute_score(solution: str, ground_truth: str, method: str = "strict", format_score: float = 0.0) -> float:
    """1.0 if the solution's final answer equals `ground_truth`, `format_score` if an answer was
    found but is wrong, 0.0 if none was found."""
    return gsm8k_score(solution, str(ground_truth), method=method, format_score=format_score)
