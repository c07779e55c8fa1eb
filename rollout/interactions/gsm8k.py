"""GSM8K interactions: a grader that asks the model to retry, and a tutor that gives hints.

Both read the sample's `interaction_kwargs`: `ground_truth` (the final number) and, for the
tutor, `solution` (GSM8K's reference solution text, steps on separate lines, `#### N` last).
Each user turn grades the last assistant message with the scorer named by `config.score_fn`
(a dotted path: the task's scorer, which the outcome reward uses too, so rollout and reward
share one scorer; without it, as in verl's `config: {}`, verl's own scorer path
`rollout.plugins.VERL_GSM8K_SCORE_FN`, which verl resolves or the loader's aliases map) with verl's strict extraction (`config.method: flexible`
opts in to the last number anywhere); a correct answer ends the conversation with score 1.0. Otherwise `Gsm8kInteraction` gives verl's "incorrect, reflect and try again" feedback and
`Gsm8kTutorInteraction` reveals the next step of the reference solution, until
`max_user_turns` (config, default 3) user turns are spent.

Departs from verl's `Gsm8kInteraction`: it has no turn limit of its own (it relies on the
rollout's); this one also stops itself after `max_user_turns`.
"""

from __future__ import annotations

import re
from typing import Any

from rollout.interactions.base import BaseInteraction
from rollout.plugins import VERL_GSM8K_SCORE_FN, import_object

_CALCULATOR = re.compile(r"<<[^>]*>>")


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    """Content of the last assistant message ('' if there is none)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


def solution_steps(solution: str) -> list[str]:
    """Reasoning steps of a GSM8K reference solution, calculator annotations and the `####` line removed."""
    steps = []
    for line in solution.splitlines():
        line = _CALCULATOR.sub("", line).strip()
        if line and not line.startswith("####"):
            steps.append(line)
    return steps


class Gsm8kInteraction(BaseInteraction):
    """Grades the last answer; asks for a retry until correct or out of user turns."""

    feedback_incorrect = "Your response is incorrect! You need to reflect on your answer and try again."

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.max_user_turns = int(self.config.get("max_user_turns", 3))
        self.score_fn = import_object(self.config.get("score_fn", VERL_GSM8K_SCORE_FN),
                                      f"interaction {self.name!r} config.score_fn")
        self.method = self.config.get("method", "strict")
        if self.max_user_turns < 1:
            raise ValueError(
                f"interaction {self.name!r}: config.max_user_turns must be >= 1, got {self.max_user_turns}"
            )
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> str:
        if ground_truth is None:
            raise ValueError(f"interaction {self.name!r} needs interaction_kwargs.ground_truth in the sample")
        instance_id = await super().start_interaction(instance_id)
        self._instances[instance_id] = {"ground_truth": str(ground_truth), "turns": 0, "score": 0.0, "kwargs": kwargs}
        return instance_id

    def _grade(self, instance_id: str, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
        state = self._instances[instance_id]
        state["turns"] += 1
        score = float(self.score_fn(last_assistant_text(messages), state["ground_truth"], method=self.method))
        state["score"] = max(state["score"], score)
        return state, score

    def _hint(self, state: dict[str, Any]) -> str:
        return self.feedback_incorrect

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        state, score = self._grade(instance_id, messages)
        meta = {"user_turn": state["turns"]}
        if score >= 1.0:
            return True, "Your response is correct!", score, meta
        if state["turns"] >= self.max_user_turns:
            return True, "Your response is incorrect, and you are out of attempts.", score, meta
        return False, self._hint(state), score, meta

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return self._instances[instance_id]["score"]

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


class Gsm8kTutorInteraction(Gsm8kInteraction):
    """Like `Gsm8kInteraction`, but each wrong answer gets the next step of the reference solution."""

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> str:
        solution = kwargs.get("solution")
        if not solution:
            raise ValueError(f"interaction {self.name!r} needs interaction_kwargs.solution (the reference solution)")
        return await super().start_interaction(instance_id, ground_truth=ground_truth, **kwargs)

    def _hint(self, state: dict[str, Any]) -> str:
        steps = solution_steps(state["kwargs"]["solution"])
        if state["turns"] > len(steps):
            return "Not quite. You have seen every step of the solution; put them together and give the final answer."
        return f"Not quite. Hint: {steps[state['turns'] - 1]}"
