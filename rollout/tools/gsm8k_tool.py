"""GSM8K answer tool (verl's `calc_gsm8k_reward`), scored by a function named in its YAML config.

The model submits its final answer through the tool; the tool scores it against the sample's
ground truth (`tools_kwargs.<tool>.create_kwargs.ground_truth`) and answers with feedback text
and a step reward, as verl's tool does:

- the score is `score_fn("#### " + answer, ground_truth, method=..., format_score=...)`;
- the step reward is 0.0 when a call improves on the instance's best score so far, and
  `penalty` (default -0.05) otherwise (discourages resubmitting the same wrong answer);
- `calc_reward` is the best score the instance reached.

The scorer is not the rollout's: `config.score_fn` is a dotted path, the task's scorer that the
outcome reward uses too (tool_configs/gsm8k_tool_config.yaml), so the tool and the outcome reward
cannot disagree. Without it (verl's `config: {type: native}`), verl's own scorer path
(`rollout.plugins.VERL_GSM8K_SCORE_FN`), which verl resolves or the loader's aliases map. Departs
from verl: verl keeps the best answer text and scores it once more in `calc_reward`; this keeps the
best score.
"""

from __future__ import annotations

from typing import Any

from rollout.plugins import VERL_GSM8K_SCORE_FN, import_object
from rollout.tools.base import BaseTool
from rollout.tools.schemas import ToolResponse
from rollout.tracing import rollout_trace_op


class Gsm8kTool(BaseTool):
    """`calc_gsm8k_reward`: checks a submitted GSM8K answer against the sample's ground truth.

    Config: `score_fn` (dotted path of `f(solution_str, ground_truth, method=, format_score=)`,
    default verl's scorer path), `method` (default flexible, as verl's tool: the answer argument is often a bare
    number), `format_score` (default 0.0), `penalty` (step reward of a non-improving call, default -0.05).
    """

    def __init__(self, config: dict[str, Any], tool_schema):
        super().__init__(config, tool_schema)
        self.score_fn = import_object(self.config.get("score_fn", VERL_GSM8K_SCORE_FN), "config.score_fn")
        self.method = self.config.get("method", "flexible")
        self.format_score = float(self.config.get("format_score", 0.0))
        self.penalty = float(self.config.get("penalty", -0.05))
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any):
        if ground_truth is None:  # the runner passes create_kwargs flat (and nested) to a **kwargs signature
            raise ValueError(
                f"tool {self.name!r} needs create_kwargs.ground_truth; put it in the sample's "
                f"extra_info.tools_kwargs.{self.name}.create_kwargs"
            )
        instance_id, _ = await super().create(instance_id)
        self._instances[instance_id] = {"ground_truth": str(ground_truth), "reward": 0.0}
        return instance_id, None

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", ""))
        solution = answer if answer.lstrip().startswith("####") else f"#### {answer}"
        reward = float(self.score_fn(solution, state["ground_truth"], method=self.method,
                                     format_score=self.format_score))
        step_reward = 0.0 if reward > state["reward"] else self.penalty
        state["reward"] = max(state["reward"], reward)
        return ToolResponse(text=f"Current parsed answer={answer} reward={reward}"), step_reward, {"correct": reward >= 1.0}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return self._instances[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
