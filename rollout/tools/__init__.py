"""Tools the policy can call during rollout: the `BaseTool` plug-in API, the YAML registry, function tools
(`function_tool`), the `ToolRunner` that enforces limits, and built-ins (gsm8k answer checker, python sandbox, MCP)."""

from rollout.tools.base import BaseTool
from rollout.tools.registry import ToolConfigError, ToolRegistry
from rollout.tools.runner import ToolCallResult, ToolLimits, ToolRunner
from rollout.tools.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolSchema,
    ToolResponse,
    ToolSchemaError,
)

__all__ = [
    "BaseTool",
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolCallResult",
    "ToolConfigError",
    "ToolLimits",
    "ToolRegistry",
    "ToolResponse",
    "ToolRunner",
    "ToolSchemaError",
]
