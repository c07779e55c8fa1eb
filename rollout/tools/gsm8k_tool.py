"""GSM8K answer tool, and the GSM8K answer extraction the reward scorer reuses.

The model submits its final answer through the tool; the tool compares it with the sample's
ground truth (given through `tools_kwargs.<tool>.create_kwargs.ground_truth`) and answers
with feedback text and a step reward, as verl's `calc_gsm8k_reward` tool does:

- the score is 1.0 when the extracted number equals the ground truth, else `format_score`;
- the step reward is 0.0 when a call improves on the instance's best score so far, and
  `-0.05` otherwise (discourages resubmitting the same wrong answer);
- `calc_reward` is the best score the instance reached.

Departs from verl's `gsm8k.compute_score`: numbers are compared by value after removing
`$`, `,` and a trailing `.` ("1,000" == "1000" == "1000.00"); verl compares strings.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from rollout.tools.base import BaseTool
from rollout.tools.schemas import ToolResponse

_STRICT = re.compile(r"#### *(-?\$?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9.,]*|-?\.[0-9]+")


def normalize_number(text: str) -> str | None:
    """`"$1,000."` -> `"1000"`; None when the text is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    normalized = format(value.normalize(), "f")
    return "0" if normalized in {"-0", "0"} else normalized


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The final answer in a solution, normalized, or None.

    `strict`: the number after the last `####` (GSM8K's answer format).
    `flexible`: the last number anywhere in the text.
    """
    if method == "strict":
        matches = _STRICT.findall(text)
    elif method == "flexible":
        matches = _NUMBER.findall(text)
    else:
        raise ValueError(f"unknown gsm8k extraction method {method!r}; use 'strict' or 'flexible'")
    for candidate in reversed(matches):
        number = normalize_number(candidate)
        if number is not None:
            return number
    return None


def gsm8k_score(
    solution: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals the ground truth, `format_score` if an answer was found
    but is wrong, 0.0 if none was found (verl's `compute_score` semantics)."""
    answer = extract_gsm8k_answer(solution, method)
    if answer is None:
        return 0.0
    truth = normalize_number(ground_truth)
    if truth is None:
        raise ValueError(
            f"gsm8k ground truth {ground_truth!r} is not a number; fix the dataset's reward_model.ground_truth"
        )
    return score if answer == truth else format_score


class Gsm8kTool(BaseTool):
    """`calc_gsm8k_reward`: checks a submitted GSM8K answer against the sample's ground truth.

    Config: `method` (strict|flexible, default flexible: the answer argument is often a bare
    number), `format_score` (default 0.0), `penalty` (step reward of a non-improving call, default -0.05).
    """

    def __init__(self, config: dict[str, Any], tool_schema):
        super().__init__(config, tool_schema)
        self.method = self.config.get("method", "flexible")
        self.format_score = float(self.config.get("format_score", 0.0))
        self.penalty = float(self.config.get("penalty", -0.05))
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any):
        if ground_truth is None:
            raise ValueError(
                f"tool {self.name!r} needs create_kwargs.ground_truth; put it in the sample's "
                f"extra_info.tools_kwargs.{self.name}.create_kwargs"
            )
        instance_id, _ = await super().create(instance_id)
        self._instances[instance_id] = {"ground_truth": str(ground_truth), "reward": 0.0}
        return instance_id, None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", ""))
        solution = answer if answer.lstrip().startswith("####") else f"#### {answer}"
        reward = gsm8k_score(solution, state["ground_truth"], self.method, self.format_score)
        step_reward = 0.0 if reward > state["reward"] else self.penalty
        state["reward"] = max(state["reward"], reward)
        parsed = extract_gsm8k_answer(solution, self.method)
        text = f"Current parsed answer={parsed} reward={reward}"
        return ToolResponse(text=text), step_reward, {"correct": reward >= 1.0}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return self._instances[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
