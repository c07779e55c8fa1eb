"""Function tools: plain Python functions as tools (verl's `multi_turn.function_tool_path`).

A Python file holds functions marked with `@function_tool` (imported as `rollout.tools.function_tool` or, as verl
users write it, `verl.tools.function_tool`):

    @function_tool                       # tool name: the function's name
    def get_weather(city: str) -> dict:
        \"\"\"Get the current weather for a city.

        Args:
            city: The city to look up.
        \"\"\"
        return {"temperature_c": 17.3}

    @function_tool("calculator", config={"timeout_s": 5})   # another name; runner limits (polyturn's addition)
    async def calc(expression: str) -> str: ...

The schema is derived as verl derives it (`transformers.utils.get_json_schema`: the type hints, the docstring's
summary and its `Args:` section; parameters without a default are required), or given whole with `schema=` (a dict
or an `OpenAIFunctionToolSchema`). A function without a docstring, an undocumented or unhinted parameter, or
`*args` / `**kwargs` is refused when the file loads, naming the function. Each function becomes a `FunctionTool`,
an ordinary tool behind a `ToolRunner`: its arguments are checked against the schema, it runs under the runner's
timeout and limits, and a raise is a tool response for the model, as for class tools. A call is `fn(**arguments)`,
with no per-trajectory instance (no `create` / `release` state, no `tools_kwargs`). Return values are read as verl
reads them: a str, a dict (as JSON text), a `ToolResponse`, or `(response, reward[, metrics])`.

Departs from verl: no process-wide registry. The decorator only marks the function; `load_function_tools` takes
the marked functions found in the file's namespace, in definition order, so a file loads the same every time.
A sync function runs in a worker thread; on timeout the call is reported as timed out but the thread runs on.
"""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout.plugins import PluginConfigError, prepare_user_imports
from rollout.tools.base import BaseTool
from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse, ToolSchemaError

MARK = "__polyturn_function_tool__"  # the attribute `function_tool` sets: (schema, config)


def function_tool(name: str | Callable[..., Any] | None = None, *, schema: Any = None,
                  config: dict[str, Any] | None = None) -> Any:
    """Mark a function as a tool (bare `@function_tool`, or `@function_tool("name", schema=..., config=...)`).

    `name`: the tool's name (default: the function's); `schema`: the whole OpenAI tool schema, instead of the
    derived one; `config`: runner limits as a tool YAML's `config` (`timeout_s`, `max_concurrency`, ...).
    The schema is built here, so a function that cannot be a tool fails at load, named."""
    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        tool_name = name if isinstance(name, str) else fn.__name__
        where = f"@function_tool {fn.__module__}.{fn.__qualname__}"
        built = _derived_schema(fn, tool_name, where) if schema is None else _given_schema(schema, tool_name, where)
        setattr(fn, MARK, (built, dict(config or {})))
        return fn

    return mark(name) if callable(name) else mark


def _given_schema(schema: Any, tool_name: str, where: str) -> OpenAIFunctionToolSchema:
    try:
        built = OpenAIFunctionToolSchema.from_dict(schema, where=f"{where}: schema")
    except ToolSchemaError as exc:
        raise PluginConfigError(str(exc)) from None
    built.function.name = tool_name
    return built


def _derived_schema(fn: Callable[..., Any], tool_name: str, where: str) -> OpenAIFunctionToolSchema:
    """The schema of `fn` as verl derives it (transformers' `get_json_schema`), named `tool_name`."""
    from transformers.utils import get_json_schema

    variadic = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise PluginConfigError(f"{where}: *args / **kwargs ({variadic}) have no JSON schema; name each parameter "
                                "(a list[T] parameter for many values)")
    try:
        raw = get_json_schema(fn)
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
        raise PluginConfigError(f"{where}: no schema can be derived ({type(exc).__name__}: {exc}); give it a "
                                "docstring with an Args: line per parameter and a type hint on each, or pass "
                                "schema=") from None
    function = {k: v for k, v in raw["function"].items() if k != "return"}  # no `return` in a tool schema
    try:
        return OpenAIFunctionToolSchema.from_dict({"type": "function", "function": {**function, "name": tool_name}},
                                                  where=where)
    except ToolSchemaError as exc:
        raise PluginConfigError(str(exc)) from None


class FunctionTool(BaseTool):
    """One marked function as a tool: `execute` is `fn(**parameters)`, its return value read as verl reads it."""

    def __init__(self, fn: Callable[..., Any], tool_schema: OpenAIFunctionToolSchema, config: dict[str, Any]):
        super().__init__(config, tool_schema)
        self.fn = fn

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        """Call the function (a sync one in a worker thread); its return value as (response, reward, metrics)."""
        if inspect.iscoroutinefunction(self.fn):
            out = await self.fn(**parameters)
        else:
            out = await asyncio.to_thread(self.fn, **parameters)
        return function_result(out)


def _response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    if hasattr(value, "text") and not isinstance(value, str):  # verl's pydantic ToolResponse
        return ToolResponse(text=value.text, image=getattr(value, "image", None), video=getattr(value, "video", None))
    return ToolResponse(text=value if isinstance(value, str) else str(value))


def function_result(out: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
    """A function's return value as (response, step reward, metrics): a str, a dict (as JSON text), a
    ToolResponse, anything else as its str(), or a tuple `(response,)` / `(response, reward)` /
    `(response, reward, metrics)` (None reward / metrics: 0.0 / {}); a tuple of another length raises."""
    if not isinstance(out, tuple):
        return _response(out), 0.0, {}
    if not 1 <= len(out) <= 3:
        raise TypeError(f"a function tool returned a tuple of {len(out)}; return (response,), (response, reward) "
                        "or (response, reward, metrics)")
    reward = out[1] if len(out) > 1 and out[1] is not None else 0.0
    metrics = out[2] if len(out) > 2 and out[2] is not None else {}
    return _response(out[0]), float(reward), dict(metrics)


def load_function_tools(path: str | Path) -> list[FunctionTool]:
    """The tools of a function-tool file: its `@function_tool` functions, in definition order. PluginConfigError
    naming the file when it is missing, fails to import, marks no function, or names two tools alike."""
    path = Path(path)
    where = f"multi_turn.function_tool_path={path}"
    if not path.is_file() or path.suffix != ".py":
        raise PluginConfigError(f"{where}: not a Python file; point it at a .py file of @function_tool functions")
    prepare_user_imports()  # `from verl.tools.function_tool import function_tool` without verl installed
    spec = importlib.util.spec_from_file_location(f"function_tools_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except PluginConfigError as exc:
        raise PluginConfigError(f"{where}: {exc}") from None
    except Exception as exc:
        raise PluginConfigError(f"{where}: importing it failed ({type(exc).__name__}: {exc})") from exc
    marked = {id(fn): fn for fn in vars(module).values() if callable(fn) and hasattr(fn, MARK)}  # aliases once
    tools = [FunctionTool(fn, *getattr(fn, MARK)) for fn in marked.values()]
    if not tools:
        raise PluginConfigError(f"{where}: no @function_tool function in it; decorate the functions to offer "
                                "(from verl.tools.function_tool import function_tool)")
    names = [t.name for t in tools]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise PluginConfigError(f"{where}: two functions are the tool {doubled[0]!r}; give one another name "
                                "(@function_tool('other_name'))")
    return tools
