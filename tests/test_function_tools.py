"""Function tools (verl's `multi_turn.function_tool_path`): a file of `@function_tool` functions loads into tools
whose schema is derived from the signature and docstring, they run through the `ToolRunner` like class tools
(argument checks, timeouts, errors as tool responses), verl's import path works without verl, and the agent loop
calls them."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout.plugins import PluginConfigError
from rollout.tools.function_tool import function_result, function_tool, load_function_tools
from rollout.tools.registry import ToolRegistry
from rollout.tools.schemas import ToolResponse
from tests.test_agent_loop import ScriptedEngine, _call, _loop, _prompt, tokenizer  # noqa: F401  (fixture)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

# A function-tool file as a verl user writes it: verl's decorator, bare and named, sync and async.
VERL_FUNCTION_TOOLS = '''
import asyncio
import time
from typing import Literal, Optional

from verl.tools.function_tool import function_tool


@function_tool
def get_weather(city: str, days: Optional[int] = None, unit: Literal["c", "f"] = "c") -> dict:
    """Get the current weather for a city.

    Args:
        city: The city to look up.
        days: How many days ahead.
        unit: The temperature unit.
    """
    return {"city": city, "days": days, "unit": unit}


@function_tool("calculator")
async def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    await asyncio.sleep(0)
    return str(a + b), 0.5, {"added": 1}


@function_tool(config={"timeout_s": 0.2})
def broken(q: str) -> str:
    """Always fails, or hangs for q == "hang".

    Args:
        q: Anything.
    """
    if q == "hang":
        time.sleep(1.0)
    raise RuntimeError("the function broke")


def helper(x):  # not a tool
    return x
'''


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_tools.py"
    path.write_text(VERL_FUNCTION_TOOLS)
    return path


def _run(registry: ToolRegistry, name: str, arguments: dict):
    async def go():
        runner = registry.runner(name)
        async with runner.session() as iid:
            return await runner.execute(iid, arguments)
    return asyncio.run(go())


def test_file_loads_with_derived_schemas(tools_file):
    """Contract: each decorated function is a tool, in file order, named by the decorator or the function; the
    schema comes from the type hints and the docstring (description, Args:, required = no default), as verl's."""
    registry = ToolRegistry.from_config(None, function_tool_path=tools_file)
    assert registry.names == ["get_weather", "calculator", "broken"]
    weather, calc, _ = registry.schemas()
    assert weather["function"]["description"] == "Get the current weather for a city."
    params = weather["function"]["parameters"]
    assert params["required"] == ["city"]
    assert params["properties"]["city"] == {"type": "string", "description": "The city to look up."}
    assert params["properties"]["days"] == {"type": "integer", "nullable": True, "description": "How many days ahead."}
    assert params["properties"]["unit"]["enum"] == ["c", "f"]
    assert calc["function"]["name"] == "calculator" and calc["function"]["parameters"]["required"] == ["a", "b"]
    assert "return" not in weather["function"]


def test_calls_run_and_failures_are_tool_responses(tools_file):
    """Contract: a call runs the function with the checked arguments (sync or async; str, dict, tuple returns read
    as verl reads them); a bad argument, a raise and a timeout each become a tool response, never an exception."""
    registry = ToolRegistry.from_config(None, function_tool_path=tools_file)
    ok = _run(registry, "get_weather", {"city": "Tokyo", "days": None})
    assert ok.error is None and ok.text == '{"city": "Tokyo", "days": null, "unit": "c"}'
    summed = _run(registry, "calculator", {"a": "2", "b": 3})  # integral text for an integer, as for class tools
    assert (summed.text, summed.step_reward, summed.metrics) == ("5", 0.5, {"added": 1})
    bad = _run(registry, "get_weather", {"city": "Tokyo", "unit": "kelvin"})
    assert bad.error.startswith("invalid_arguments") and "unit" in bad.text and bad.text.startswith("Error")
    missing = _run(registry, "calculator", {"a": 1})
    assert "'b' is a required property" in missing.text
    raised = _run(registry, "broken", {"q": "x"})
    assert raised.error == "RuntimeError: the function broke" and "the function broke" in raised.text
    hung = _run(registry, "broken", {"q": "hang"})
    assert hung.timed_out and "timed out after 0.2s" in hung.text


def test_return_values_read_as_verl_reads_them():
    """Contract: str, dict (JSON text), ToolResponse, other values (str()), and (response, reward[, metrics])
    tuples with None for 0.0 / {}; a tuple of another length is an error."""
    assert function_result("hi") == (ToolResponse(text="hi"), 0.0, {})
    assert function_result({"a": "é"}) == (ToolResponse(text='{"a": "é"}'), 0.0, {})
    assert function_result(ToolResponse(text="t"))[0].text == "t"
    assert function_result(3) == (ToolResponse(text="3"), 0.0, {})
    assert function_result(("r", None, None)) == (ToolResponse(text="r"), 0.0, {})
    assert function_result(("r", 1)) == (ToolResponse(text="r"), 1.0, {})
    with pytest.raises(TypeError, match="tuple of 4"):
        function_result((1, 2, 3, 4))


def test_verl_import_path_loads_without_verl(tools_file):
    """Contract: `from verl.tools.function_tool import function_tool` works in a fresh process without verl, and the
    file's tools load (the decorator is polyturn's, through rollout.plugins.VERL_ALIASES)."""
    code = textwrap.dedent(f"""
        import importlib.util
        assert importlib.util.find_spec("verl") is None, "verl is installed"
        from rollout.tools.registry import ToolRegistry
        print(ToolRegistry.from_config(None, function_tool_path={str(tools_file)!r}).names)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "['get_weather', 'calculator', 'broken']"


def test_yaml_and_function_tools_share_one_registry(tools_file, tmp_path):
    """Contract: tool YAML and function tools load together (YAML first); a name used by both is refused."""
    yaml_tools = {"tools": [{"class_name": "rollout.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"},
                             "tool_schema": {"type": "function", "function": {
                                 "name": "calc_gsm8k_reward", "description": "d", "parameters": {
                                     "type": "object", "properties": {"answer": {"type": "string"}},
                                     "required": ["answer"]}}}}]}
    from recipe.tasks import verl_aliases

    both = ToolRegistry.from_config(yaml_tools, verl_aliases(), function_tool_path=tools_file)
    assert both.names == ["calc_gsm8k_reward", "get_weather", "calculator", "broken"]
    yaml_tools["tools"][0]["tool_schema"]["function"]["name"] = "calculator"
    with pytest.raises(PluginConfigError, match="two tools are named 'calculator'"):
        ToolRegistry.from_config(yaml_tools, verl_aliases(), function_tool_path=tools_file)


@pytest.mark.parametrize("source, message", [
    ("def f(x: int):\n    return x\n", "no @function_tool function"),
    ("from verl.tools.function_tool import function_tool\n@function_tool\ndef f(x: int):\n    return x\n",
     "no schema can be derived"),
    ("from verl.tools.function_tool import function_tool\n@function_tool\ndef f(*xs: int):\n"
     "    '''Sum.\n\n    Args:\n        xs: numbers\n    '''\n", "have no JSON schema"),
    ("import no_such_module_here\n", "importing it failed"),
])
def test_mistakes_are_refused_at_load_naming_the_file(tmp_path, source, message):
    """Contract: a file with no tool, a function without a derivable schema, variadic parameters, or a failing import
    is refused at load, naming the key and the file."""
    path = tmp_path / "t.py"
    path.write_text(source)
    with pytest.raises(PluginConfigError, match=message) as err:
        load_function_tools(path)
    assert str(err.value).startswith(f"multi_turn.function_tool_path={path}")
    with pytest.raises(PluginConfigError, match="not a Python file"):
        load_function_tools(tmp_path / "missing.py")


def test_explicit_schema_is_used_as_given():
    """Contract: `schema=` bypasses derivation (the decorator's name wins), and needs no docstring."""
    @function_tool("lookup", schema={"type": "function", "function": {
        "name": "ignored", "description": "look up", "parameters": {
            "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}})
    def lookup(key):
        return key.upper()

    (schema, config) = lookup.__polyturn_function_tool__
    assert schema.function.name == "lookup" and schema.function.description == "look up" and config == {}
    assert lookup("a") == "A"  # the function itself is unchanged


def test_agent_loop_calls_a_function_tool(tokenizer, tools_file):
    """Contract: in the agent loop a function tool is offered in the prompt and its result is the tool message."""
    registry = ToolRegistry.from_config(None, function_tool_path=tools_file)
    policy = lambda uid, turn: [_call("calculator", a=2, b=3), "The answer is 5."][turn]
    engine = ScriptedEngine(tokenizer, policy)
    loop = _loop(tokenizer, engine, [r.tool for r in registry.runners.values()])
    (traj,) = asyncio.run(loop.generate([_prompt("q")]))
    assert '"name": "calculator"' in tokenizer.decode(traj.prompt_ids)
    (call,) = traj.tool_calls
    assert (call.name, call.result, call.step_reward) == ("calculator", "5", 0.5)
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
