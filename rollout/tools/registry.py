"""Tool registry: tools from verl's tool YAML (through `rollout.plugins`), per-sample selection.

    tools:
      - class_name: rollout.tools.gsm8k_tool.Gsm8kTool      # any class with verl's tool methods
        config: {type: native, timeout_s: 10}                 # given to the tool (+ runner limits)
        tool_schema: {type: function, function: {name, description, parameters}}
      - class_name: rollout.tools.mcp_tool.MCPTool            # one tool per MCP server tool
        config: {type: mcp}
        mcp: {mcp_servers_config_path: mcp_servers.json, tool_selected_list: [search]}

Every mistake is refused at load, naming the entry (`tools[2]`) and the fix: a class that
cannot be imported or lacks verl's tool methods, an invalid schema or none (an entry may leave
`tool_schema` out when its class provides one, as verl allows), two tools with the same name,
bad runner limits.

Function tools (verl's `multi_turn.function_tool_path`: a Python file of `@function_tool` functions,
`rollout.tools.function_tool`) join the YAML's tools in one registry (`from_config(..., function_tool_path=)`);
a name used by both is refused, as in verl.

Per-sample selection follows verl: a sample's `tools_kwargs` keys name the tools it may use
(`select`); a sample without `tools_kwargs` gets every registered tool.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.plugins import (PluginConfigError, Registry, added_aliases, build, check_keys, check_runner, import_class,
                             read_entries)
from rollout.tools.runner import ToolRunner, provided_schema
from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolSchemaError

ToolConfigError = PluginConfigError  # the tools' name for it

TOOL_METHODS = ("create", "execute", "calc_reward", "release")
_TOOL_TYPES = {"native", "mcp"}


class ToolRegistry(Registry[ToolRunner]):
    """The tools of one rollout, by name, each behind its `ToolRunner`."""

    kind = "tool"
    runner_cls = ToolRunner

    @classmethod
    def from_config(cls, source: str | Path | dict[str, Any] | None, aliases: Mapping[str, str] | None = None,
                    function_tool_path: str | Path | None = None) -> ToolRegistry:
        """The tools of a tool YAML (path or mapping; None: none) and of a function-tool file (None: none), the
        YAML's first; `aliases` as in `Registry.from_config`."""
        from rollout.tools.function_tool import load_function_tools

        with added_aliases(aliases):
            tools = cls.load(source) if source is not None else []
            tools += load_function_tools(function_tool_path) if function_tool_path is not None else []
        return cls(tools)

    @staticmethod
    def load(source: str | Path | dict[str, Any]) -> list[Any]:
        """All tools of a tool config (YAML path or mapping), in file order."""
        from rollout.tools.mcp_tool import tools_from_mcp_servers

        entries, label, base_dir = read_entries(source, "tools")
        tools: list[Any] = []
        for i, entry in enumerate(entries):
            where = f"{label}: tools[{i}]"
            check_keys(entry, {"class_name", "config", "tool_schema", "mcp"}, where)
            cls = import_class(entry.get("class_name"), f"{where}.class_name", TOOL_METHODS)
            config = dict(entry.get("config") or {})
            kind = config.get("type", "mcp" if "mcp" in entry else "native")
            if kind not in _TOOL_TYPES or (kind == "mcp") != ("mcp" in entry):
                raise ToolConfigError(f"{where}.config.type: {kind!r} needs {'an' if kind == 'mcp' else 'no'} `mcp:` "
                                      "section; use type native (with tool_schema) or mcp (with mcp:)")
            if "mcp" in entry:
                built = tools_from_mcp_servers(cls, config, entry["mcp"], base_dir, where)
            elif entry.get("tool_schema") is None:
                built = [_tool_with_own_schema(cls, config, where)]
            else:
                try:
                    schema = OpenAIFunctionToolSchema.from_dict(entry["tool_schema"], where=f"{where}.tool_schema")
                except ToolSchemaError as exc:
                    raise ToolConfigError(str(exc)) from None
                built = [build(cls, where, config=config, tool_schema=schema)]
            for tool in built:
                check_runner(ToolRunner, tool, where)
            tools.extend(built)
        return tools

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
        return [self.runner(n).schema.to_openai() for n in (names or self.names)]


def _tool_with_own_schema(cls: type, config: dict[str, Any], where: str) -> Any:
    """A tool whose entry has no `tool_schema`, built as verl builds it (`tool_schema=None`) when its class provides
    the schema (`get_openai_tool_schema()` or a `tool_schema` attribute); refused naming the entry otherwise."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    fix = ("add `tool_schema: {type: function, function: {name, description, parameters}}` to the entry, or have "
           "the class give one (`get_openai_tool_schema()` or a `tool_schema` class attribute)")
    try:
        tool = cls(config=config, tool_schema=None)
        schema = provided_schema(tool)
    except Exception as exc:
        raise ToolConfigError(f"{where}: no tool_schema, and building {name} without one failed "
                              f"({type(exc).__name__}: {exc}); {fix}") from exc
    if schema is None:
        raise ToolConfigError(f"{where}: no tool_schema, and {name} provides none; {fix}")
    return tool
