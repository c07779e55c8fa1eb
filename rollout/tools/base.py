"""`BaseTool`: the one plug-in signature every tool implements (verl-compatible).

A tool is one object shared by every trajectory; per-trajectory state lives under an
`instance_id` that `create` hands out and `release` frees. The agent loop calls, per sample
(`*_kwargs` come from the sample's `tools_kwargs.<tool>`; with these `**kwargs` signatures each
method gets them both ways at once, flat and nested, as verl's tools read either):

    instance_id, _ = await tool.create(**create_kwargs, create_kwargs=create_kwargs)
    response, step_reward, metrics = await tool.execute(instance_id, arguments, **execute_kwargs, execute_kwargs=...)
    reward = await tool.calc_reward(instance_id, **calc_reward_kwargs, calc_reward_kwargs=...)
    await tool.release(instance_id, **release_kwargs, release_kwargs=...)      # always, also on errors

A method without `**kwargs` gets the shape its named parameters ask for (`create(self,
create_kwargs)`: nested; `create(self, ground_truth)`: flat); `rollout.plugins.kwargs_shape`.

Never call a tool directly from rollout code: go through `rollout.tools.runner.ToolRunner`,
which adds timeouts, concurrency and rate limits, turns exceptions into tool responses and
guarantees `release`.

Subclassing is optional: the loader takes any class with these methods (verl's classes as they
are). `create` may return just an id (verl <= 0.4) or `(id, response|None)` (verl >= 0.5);
`execute` may return a `str`, a dict (`text`, `image`, `video`) or a `ToolResponse`.
"""

from __future__ import annotations

import uuid
from typing import Any

from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse, ToolSchemaError


class BaseTool:
    """Base class of polyturn tools; subclass and override `execute` (and the others as needed).

    `config` is the YAML entry's `config` mapping; `tool_schema` its `tool_schema`, or None when the
    entry has none: then the class provides it, as in verl (a `tool_schema` class attribute, or
    `get_openai_tool_schema()` overridden). The tool's `name` is the schema's function name: the
    name the model calls it by.
    """

    tool_schema: OpenAIFunctionToolSchema | None = None  # a subclass may set its schema here

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ToolSchemaError(f"{type(self).__name__} has no tool schema: pass one, or set the class's "
                                  "`tool_schema` or override `get_openai_tool_schema()`")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema shown to the model (verl's accessor)."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse | None]:
        """Start a per-trajectory instance (`kwargs`: the sample's create_kwargs, flat and under
        `create_kwargs`); returns its id and an optional initial response."""
        return instance_id or str(uuid.uuid4()), None

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[str | ToolResponse, float, dict[str, Any]]:
        """Run one call. Returns (response for the model, step reward, metrics)."""
        raise NotImplementedError(f"{type(self).__name__}.execute is not implemented; override it in your tool")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward so far (used as the tool reward of the trajectory)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free the instance's state. Called exactly once per `create`, also after errors."""

    async def close(self) -> None:
        """Free resources shared by all instances (servers, pools). Optional; called once by the registry."""
