"""Tool registry: builds tools from verl's YAML format and hands out their runners.

    tools:
      - class_name: rollout.tools.gsm8k_tool.Gsm8kTool     # dotted path to a BaseTool subclass
        config: {type: native, timeout_s: 10}                # passed to the tool (+ runner limits)
        tool_schema: {type: function, function: {name, description, parameters}}

Every mistake is refused at load, naming the entry (`tools[2]`) and the fix: a class that
cannot be imported or is not a `BaseTool`, a missing or invalid schema, two tools with the
same name. One entry may expand to several tools when the class overrides
`BaseTool.from_config` (the MCP adapter exposes every tool of its server this way).

Per-sample selection follows verl: a sample's `tools_kwargs` keys name the tools it may use
(`select`); a sample without `tools_kwargs` gets every registered tool.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import yaml

from rollout.tools.base import BaseTool
from rollout.tools.runner import ToolLimits, ToolRunner
from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolSchemaError

logger = logging.getLogger(__name__)


class ToolConfigError(ValueError):
    """A tool YAML entry is wrong; the message names the entry and the fix."""


def import_class(dotted: Any, where: str, base: type) -> type:
    """Import `package.module.Class` and check it subclasses `base`; errors name `where`."""
    if not isinstance(dotted, str) or "." not in dotted:
        raise ToolConfigError(f"{where}.class_name: expected a dotted path like 'package.module.Class', got {dotted!r}")
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolConfigError(
            f"{where}.class_name: cannot import module {module_name!r} ({exc}); check the path and that it is installed"
        ) from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise ToolConfigError(
            f"{where}.class_name: module {module_name!r} has no attribute {attr!r}; check the class name"
        )
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ToolConfigError(
            f"{where}.class_name: {dotted} is not a subclass of {base.__module__}.{base.__name__}; derive from it"
        )
    return cls


def read_yaml_list(source: str | Path | dict[str, Any], key: str) -> tuple[list[Any], str]:
    """The list under `key` of a YAML file (or an already-loaded mapping), and a label for errors."""
    if isinstance(source, dict):
        data, label = source, "<config>"
    else:
        path = Path(source)
        if not path.is_file():
            raise ToolConfigError(
                f"config file {path} does not exist; pass the path of a YAML file with a '{key}:' list"
            )
        data, label = yaml.safe_load(path.read_text()) or {}, str(path)
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise ToolConfigError(f"{label}: expected a top-level '{key}:' list")
    return data[key], label


def build_tools(source: str | Path | dict[str, Any]) -> list[BaseTool]:
    """All tools of a tool config (YAML path or mapping), in file order."""
    entries, label = read_yaml_list(source, "tools")
    tools: list[BaseTool] = []
    for i, entry in enumerate(entries):
        where = f"{label}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: expected a mapping with class_name, config, tool_schema")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ToolConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: class_name, config, tool_schema")
        cls = import_class(entry.get("class_name"), where, BaseTool)
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config: expected a mapping, got {type(config).__name__}")
        schema = None
        if entry.get("tool_schema") is not None:
            try:
                schema = OpenAIFunctionToolSchema.from_dict(entry["tool_schema"], where=f"{where}.tool_schema")
            except ToolSchemaError as exc:
                raise ToolConfigError(str(exc)) from None
        try:
            built = cls.from_config(config, schema)
        except ToolConfigError:
            raise
        except Exception as exc:
            raise ToolConfigError(f"{where}: building {cls.__name__} failed: {type(exc).__name__}: {exc}") from exc
        for tool in built:
            try:
                ToolLimits.from_config(tool.config, tool.name)
            except ValueError as exc:
                raise ToolConfigError(f"{where}: {exc}") from None
        tools.extend(built)
    return tools


class ToolRegistry:
    """The tools of one rollout, by name, each behind its `ToolRunner`."""

    def __init__(self, tools: list[BaseTool]):
        self.runners: dict[str, ToolRunner] = {}
        for tool in tools:
            if tool.name in self.runners:
                raise ToolConfigError(
                    f"two tools are named {tool.name!r}; tool names must be unique (rename one tool_schema.function.name)"
                )
            self.runners[tool.name] = ToolRunner(tool)

    @classmethod
    def from_config(cls, source: str | Path | dict[str, Any] | None) -> ToolRegistry:
        """Registry from a YAML path or mapping (None: no tools)."""
        return cls(build_tools(source) if source is not None else [])

    @property
    def names(self) -> list[str]:
        """Names of the registered tools, in config order."""
        return list(self.runners)

    def runner(self, name: str) -> ToolRunner:
        """The runner of tool `name`; KeyError naming the known tools otherwise."""
        if name not in self.runners:
            raise KeyError(f"unknown tool {name!r}; known tools: {self.names}")
        return self.runners[name]

    def select(self, tools_kwargs: dict[str, Any] | None) -> list[str]:
        """Names of the tools a sample may use: the keys of its `tools_kwargs`, or all when it has none."""
        if not tools_kwargs:
            return self.names
        self.validate_sample(tools_kwargs)
        return list(tools_kwargs)

    def validate_sample(self, tools_kwargs: dict[str, Any] | None) -> None:
        """Refuse a sample whose `tools_kwargs` names a tool that is not registered (for data validation)."""
        unknown = [k for k in (tools_kwargs or {}) if k not in self.runners]
        if unknown:
            raise ToolConfigError(f"tools_kwargs names unknown tools {unknown}; registered tools: {self.names}")

    def schemas(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI tool schemas (for the chat template) of `names`, default all."""
        return [self.runner(n).tool.get_openai_tool_schema().to_openai() for n in (names or self.names)]

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per tool: (instances created, instances released)."""
        return {n: (r.num_created, r.num_released) for n, r in self.runners.items()}

    async def aclose(self) -> None:
        """Close every tool's shared resources (e.g. MCP server connections)."""
        for runner in self.runners.values():
            try:
                await runner.tool.close()
            except Exception:  # noqa: BLE001
                logger.exception("closing tool %r failed", runner.name)
