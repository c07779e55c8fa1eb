"""Tool plug-in contract, YAML registry errors, runner limits and faults, and the GSM8K tool."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.tools import (
    BaseTool,
    OpenAIFunctionCallSchema,
    OpenAIFunctionToolSchema,
    ToolConfigError,
    ToolRegistry,
    ToolResponse,
    ToolRunner,
)

REPO = Path(__file__).resolve().parents[1]

# A tool as a user would write it in their own package, against the documented signature only.
USER_TOOL_MODULE = '''
import asyncio
import functools
from rollout.tools import BaseTool, ToolResponse

EVENTS = []

class CounterTool(BaseTool):
    """Adds to a per-instance counter; the step reward is the increment."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.state = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id, _ = await super().create(instance_id)
        self.state[instance_id] = kwargs["create_kwargs"].get("start", 0)
        EVENTS.append(("create", instance_id))
        return instance_id, ToolResponse(text="ready")

    async def execute(self, instance_id, parameters, **kwargs):
        self.state[instance_id] += parameters["by"]
        return f"total={self.state[instance_id]}", float(parameters["by"]), {"total": self.state[instance_id]}

    async def calc_reward(self, instance_id, **kwargs):
        return float(self.state[instance_id])

    async def release(self, instance_id, **kwargs):
        EVENTS.append(("release", instance_id))
        del self.state[instance_id]


class OldStyleTool(BaseTool):
    """verl <= 0.4: create returns just the id, execute returns a str."""

    async def create(self, instance_id=None, **kwargs):
        return instance_id or "old-1"

    async def execute(self, instance_id, parameters, **kwargs):
        return "ok", 0.0, {}


class NotATool:
    pass
'''

COUNTER_SCHEMA = {
    "type": "function",
    "function": {
        "name": "counter",
        "description": "Add to a counter.",
        "parameters": {
            "type": "object",
            "properties": {"by": {"type": "integer", "description": "amount"}},
            "required": ["by"],
        },
    },
}


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A user's own module `user_tools` importable by dotted path, as a YAML would name it."""
    (tmp_path / "user_tools.py").write_text(USER_TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    sys.modules.pop("user_tools", None)
    return importlib.import_module("user_tools")


def write_yaml(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def schema(name: str, properties: dict | None = None, required: list[str] | None = None) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": properties or {}, "required": required or []},
        },
    }


class ScriptedTool(BaseTool):
    """Test tool whose execute behaviour is set per instance of the class."""

    def __init__(self, config, tool_schema, behaviour=None):
        super().__init__(config, tool_schema)
        self.behaviour = behaviour
        self.in_flight = 0
        self.max_in_flight = 0
        self.starts: list[float] = []
        self.cancelled = 0
        self.calls = 0

    async def execute(self, instance_id, parameters, **kwargs):
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.starts.append(time.monotonic())
        try:
            return await self.behaviour(parameters)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


def scripted(behaviour, **config) -> ToolRunner:
    tool = ScriptedTool(config, OpenAIFunctionToolSchema.from_dict(schema("t", {"x": {"type": "integer"}})), behaviour)
    return ToolRunner(tool)


# ---------------------------------------------------------------- contract


@pytest.mark.unit
def test_user_tool_loads_from_yaml_and_runs_full_lifecycle(tmp_path, user_package):
    """Contract: a tool written against the documented BaseTool signature works via the YAML registry:
    create (verl's `create_kwargs=`) -> execute (response, step reward, metrics) -> calc_reward -> release."""
    path = write_yaml(
        tmp_path,
        {
            "tools": [
                {"class_name": "user_tools.CounterTool", "config": {"timeout_s": 5}, "tool_schema": COUNTER_SCHEMA}
            ]
        },
    )
    registry = ToolRegistry.from_config(path)
    assert registry.names == ["counter"]
    assert registry.schemas() == [COUNTER_SCHEMA]
    runner = registry.runner("counter")

    async def trajectory():
        async with runner.session(create_kwargs={"start": 10}) as iid:
            first = await runner.execute(iid, {"by": 2})
            second = await runner.execute(iid, {"by": 3})
            reward = await runner.calc_reward(iid)
        return iid, first, second, reward

    iid, first, second, reward = asyncio.run(trajectory())
    # create's response ("ready") reaches the model with the instance's first result
    assert (first.text, first.step_reward, first.metrics) == ("ready\ntotal=12", 2.0, {"total": 12})
    assert (second.text, second.step_reward, second.error) == ("total=15", 3.0, None)
    assert reward == 15.0
    assert user_package.EVENTS == [("create", iid), ("release", iid)]
    assert registry.counts() == {"counter": (1, 1)}


@pytest.mark.unit
def test_old_style_tool_return_shapes_are_accepted(tmp_path, user_package):
    """Contract: verl <= 0.4 tools (create returns the id, execute returns a str) still run."""
    registry = ToolRegistry.from_config(
        {"tools": [{"class_name": "user_tools.OldStyleTool", "tool_schema": schema("old")}]}
    )
    runner = registry.runner("old")

    async def go():
        async with runner.session() as iid:
            return iid, await runner.execute(iid, {})

    iid, result = asyncio.run(go())
    assert iid == "old-1" and result.text == "ok" and result.response == ToolResponse(text="ok")


@pytest.mark.unit
def test_per_sample_tool_selection_by_tools_kwargs():
    """Contract: a sample's tools_kwargs keys choose its tools; none -> all; an unknown tool is refused
    naming the registered ones (so bad data fails at validation)."""
    registry = ToolRegistry.from_config(REPO / "tool_configs" / "gsm8k_tool_config.yaml")
    assert registry.select(None) == ["calc_gsm8k_reward"]
    assert registry.select({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "3"}}}) == ["calc_gsm8k_reward"]
    with pytest.raises(ToolConfigError, match=r"unknown tools \['search'\].*calc_gsm8k_reward"):
        registry.validate_sample({"search": {}})


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gsm8k_tool_config.yaml", "python_tool_config.yaml"])
def test_shipped_tool_configs_load(name):
    """The YAML files the recipes use load, with schemas the chat template can render."""
    registry = ToolRegistry.from_config(REPO / "tool_configs" / name)
    for entry in registry.schemas():
        assert entry["type"] == "function" and entry["function"]["parameters"]["type"] == "object"


# ---------------------------------------------------------------- schemas


@pytest.mark.unit
def test_argument_validation_names_the_bad_argument():
    """Arguments that do not fit the schema are reported per argument (missing, wrong type, not in enum), with the same
    messages whether checked as verl's tools read them (default) or as written when the tool opts in (strict)."""
    s = OpenAIFunctionToolSchema.from_dict(
        schema(
            "convert", {"value": {"type": "number"}, "unit": {"type": "string", "enum": ["C", "F"]}}, ["value", "unit"]
        )
    )
    assert s.check_arguments({"value": 3, "unit": "C"}) == ({"value": 3, "unit": "C"}, [])
    assert s.check_arguments({"unit": "C"})[1] == ["arguments: 'value' is a required property"]
    assert s.check_arguments({"value": True, "unit": "K"})[1] == [
        "unit: 'K' is not one of ['C', 'F']",
        "value: True is not of type 'number'",
    ]
    assert s.check_arguments([1, 2])[1] == ["arguments: must be a JSON object, got list"]
    strict = s.with_strict_arguments(True)
    assert not s.strict_arguments and strict.strict_arguments
    assert strict.check_arguments({"unit": "C"})[1] == ["arguments: 'value' is a required property"]
    assert strict.check_arguments({"value": "3", "unit": "K"})[1] == [
        "unit: 'K' is not one of ['C', 'F']",
        "value: '3' is not of type 'number'",
    ]


# What a tool relies on once its arguments are checked: nested objects, arrays, bounds, an enum.
NESTED_PROPERTIES = {
    "count": {"type": "integer", "minimum": 0, "maximum": 10},
    "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "tags": {"type": "array", "items": {"type": "string"}},
    "mode": {"type": "string", "enum": ["fast", "slow"]},
    "opts": {"type": "object", "required": ["depth"], "properties": {
        "depth": {"type": "integer", "minimum": 1}, "sizes": {"type": "array", "items": {"type": "integer"}}}},
}


@functools.cache
def nested_schema(strict: bool = False) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.from_dict(schema("t", NESTED_PROPERTIES)).with_strict_arguments(strict)


def fits_nested_schema(args: dict) -> bool:
    """NESTED_PROPERTIES checked by hand, apart from jsonschema: what the tool may assume of its arguments."""
    def ints(v):
        return type(v) is list and all(type(n) is int for n in v)

    checks = {
        "count": lambda v: type(v) is int and 0 <= v <= 10,
        "ratio": lambda v: type(v) is float and 0 < v < 1,
        "tags": lambda v: type(v) is list and all(type(t) is str for t in v),
        "mode": lambda v: type(v) is str and v in ("fast", "slow"),
        "opts": lambda v: type(v) is dict and type(v.get("depth")) is int and v["depth"] >= 1
        and ints(v.get("sizes", [])),
    }
    return all(check(args[key]) for key, check in checks.items() if key in args)


@pytest.mark.unit
@pytest.mark.parametrize("strict", [False, True])
def test_an_integral_number_is_an_integer(strict):
    """Contract (issue 33): `3.0` fits an integer field, as in JSON schema, and reaches the tool as the int 3, also
    nested; `3.5` and booleans are never integers; a number field keeps its float."""
    s = nested_schema(strict)
    taken, errors = s.check_arguments({"count": 3.0, "ratio": 0.5, "opts": {"depth": 2.0, "sizes": [1.0, -4]}})
    assert errors == [] and taken == {"count": 3, "ratio": 0.5, "opts": {"depth": 2, "sizes": [1, -4]}}
    assert fits_nested_schema(taken) and type(taken["count"]) is int
    assert s.check_arguments({"count": 3.5})[1] == ["count: 3.5 is not of type 'integer'"]
    assert s.check_arguments({"count": True})[1] == ["count: True is not of type 'integer'"]
    assert s.check_arguments({"opts": {"depth": 1, "sizes": [False]}})[1] == [
        "opts.sizes.0: False is not of type 'integer'"]


@pytest.mark.unit
def test_default_mode_checks_the_whole_schema_after_coercion():
    """Contract (issue 33): by default arguments are coerced as verl's tools read them, at any depth, then checked
    against the whole schema: array item types, numeric bounds, enums, required keys and types in nested objects."""
    s = nested_schema()
    assert s.check_arguments({"count": "3", "tags": [1, "a"], "opts": {"depth": "2"}}) == (
        {"count": 3, "tags": ["1", "a"], "opts": {"depth": 2}}, [])
    for arguments, error in [
        ({"tags": [None]}, "tags.0: None is not of type 'string'"),
        ({"count": -1}, "count: -1 is less than the minimum of 0"),
        ({"count": "11"}, "count: 11 is greater than the maximum of 10"),
        ({"ratio": 1}, "ratio: 1 is greater than or equal to the maximum of 1"),
        ({"ratio": 0.0}, "ratio: 0.0 is less than or equal to the minimum of 0"),
        ({"ratio": float("nan")}, "ratio: nan is not of type 'number'"),  # Python's json reads NaN; JSON has none
        ({"mode": "medium"}, "mode: 'medium' is not one of ['fast', 'slow']"),
        ({"opts": {}}, "opts: 'depth' is a required property"),
        ({"opts": {"depth": 0}}, "opts.depth: 0 is less than the minimum of 1"),
        ({"opts": {"depth": 1, "sizes": ["x"]}}, "opts.sizes.0: 'x' is not of type 'integer'"),
        ({"opts": [1]}, "opts: [1] is not of type 'object'"),
    ]:
        assert s.check_arguments(arguments)[1] == [error], arguments


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.floats(),
                     st.sampled_from(["3", " 7 ", "-1", "3.0", "fast", "x", ""]))
_keys = st.sampled_from(["count", "ratio", "tags", "mode", "opts", "depth", "sizes", "other"])
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
                       max_leaves=12)


def _nest(value, levels: int):
    for i in range(levels):
        value = {"opts": value} if i % 2 else [value]
    return value


@pytest.mark.unit
@given(arguments=st.one_of(st.dictionaries(_keys, _values, max_size=5), _values,
                           st.builds(lambda v, n: {"opts": _nest(v, n)}, _values, st.integers(0, 80))),
       strict=st.booleans())
@settings(max_examples=200, deadline=None)
def test_checked_arguments_always_fit_the_schema(arguments, strict):
    """Property (issue 33): for any nested arguments (any depth), checking never raises and either refuses them with
    errors naming an argument, or hands the tool arguments that fit the schema."""
    taken, errors = nested_schema(strict).check_arguments(arguments)
    assert all(isinstance(e, str) and ": " in e for e in errors)
    assert errors or fits_nested_schema(taken)


@pytest.mark.unit
def test_arguments_out_of_schema_never_reach_the_tool():
    """Contract (issue 33): a value out of bounds or of the wrong item type is an `invalid_arguments` response naming
    it, and the tool is not called; `3.0` for an integer runs the tool with the int 3."""
    seen = []

    async def behaviour(params):
        seen.append(params)
        return "ran", 0.0, {}

    runner = ToolRunner(ScriptedTool({}, nested_schema(), behaviour))
    bad = asyncio.run(runner.execute("i", {"count": -1, "tags": [None]}))
    assert bad.error == "invalid_arguments: count: -1 is less than the minimum of 0; tags.0: None is not of type 'string'"
    assert seen == []
    assert asyncio.run(runner.execute("i", {"count": 3.0})).error is None
    assert seen == [{"count": 3}] and type(seen[0]["count"]) is int


@pytest.mark.unit
def test_function_call_decoding_reports_bad_json():
    """A call whose arguments are not a JSON object is decoded to {} plus an error, never an exception."""
    assert OpenAIFunctionCallSchema.from_raw("f", '{"a": 1}') == (OpenAIFunctionCallSchema(name="f", arguments={"a": 1}), None)
    call, err = OpenAIFunctionCallSchema.from_raw("f", '{"a": ')
    assert call.arguments == {} and "not valid JSON" in err
    call, err = OpenAIFunctionCallSchema.from_raw("f", "[1]")
    assert call.arguments == {} and "JSON object" in err


# ---------------------------------------------------------------- YAML errors


@pytest.mark.unit
@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"class_name": "no_such_module.Tool", "tool_schema": schema("a")},
            r"tools\[1\]\.class_name: cannot import module 'no_such_module'",
        ),
        (
            {"class_name": "user_tools.Missing", "tool_schema": schema("a")},
            r"tools\[1\]\.class_name: module 'user_tools' has no attribute 'Missing'",
        ),
        (
            {"class_name": "user_tools.NotATool", "tool_schema": schema("a")},
            r"tools\[1\]\.class_name: user_tools\.NotATool lacks \[.create., .execute., .calc_reward., .release.\]",
        ),
        ({"class_name": "CounterTool", "tool_schema": schema("a")}, r"tools\[1\]\.class_name: expected a dotted path"),
        (
            {"class_name": "user_tools.CounterTool"},
            r"tools\[1\]: no tool_schema, and building user_tools\.CounterTool without one failed",
        ),
        (
            {
                "class_name": "user_tools.CounterTool",
                "tool_schema": {"type": "function", "function": {"description": "x"}},
            },
            r"tools\[1\]\.tool_schema\.function\.name: must be a non-empty string",
        ),
        (
            {
                "class_name": "user_tools.CounterTool",
                "tool_schema": {"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}},
            },
            r"tools\[1\]\.tool_schema\.function\.parameters\.type: must be 'object'",
        ),
        (
            {"class_name": "user_tools.CounterTool", "tool_schema": schema("a", {"x": {"type": "str"}})},
            r"tools\[1\]\.tool_schema\.function\.parameters.*properties\.x\.type",
        ),
        (
            {"class_name": "user_tools.CounterTool", "tool_schema": schema("a", {"x": {"type": "string"}}, ["y"])},
            r"'y' is required but not listed in properties",
        ),
        ({"class_name": "user_tools.CounterTool", "tool_schema": schema("counter")}, r"two tools are named 'counter'"),
        (
            {"class_name": "user_tools.CounterTool", "tool_schema": schema("a"), "cfg": {}},
            r"tools\[1\]: unknown keys \['cfg'\]",
        ),
        (
            {"class_name": "user_tools.CounterTool", "tool_schema": schema("a"), "config": {"timeout_s": 0}},
            r"tools\[1\]: tool 'a': config\.timeout_s must be > 0",
        ),
    ],
)
def test_bad_yaml_entries_are_refused_at_load_naming_the_entry(tmp_path, user_package, entry, message):
    """YAML errors fail at load with the file, the entry index and what to fix — never mid-rollout."""
    good = {"class_name": "user_tools.CounterTool", "tool_schema": COUNTER_SCHEMA}
    path = write_yaml(tmp_path, {"tools": [good, entry]})
    with pytest.raises(ToolConfigError, match=message) as info:
        ToolRegistry.from_config(path)
    if "two tools" not in message:
        assert str(path) in str(info.value)


@pytest.mark.unit
def test_missing_file_and_missing_list_are_refused(tmp_path):
    """A wrong path or a file without `tools:` names the file and the expected key."""
    with pytest.raises(ToolConfigError, match="does not exist"):
        ToolRegistry.from_config(tmp_path / "nope.yaml")
    path = tmp_path / "t.yaml"
    path.write_text("tool:\n  - class_name: x.Y\n")
    with pytest.raises(ToolConfigError, match="expected a top-level 'tools:' list"):
        ToolRegistry.from_config(path)


# ---------------------------------------------------------------- runner faults and limits


@pytest.mark.unit
def test_tool_that_raises_becomes_an_error_response_and_later_calls_work():
    """Fault: an exception inside a tool is returned to the model as text with `error` set; the runner goes on."""

    async def behaviour(params):
        if params["x"] == 0:
            raise ZeroDivisionError("division by zero")
        return str(10 // params["x"]), 1.0, {}

    runner = scripted(behaviour)

    async def go():
        return await runner.execute("i", {"x": 0}), await runner.execute("i", {"x": 5})

    bad, good = asyncio.run(go())
    assert bad.error == "ZeroDivisionError: division by zero" and "ZeroDivisionError" in bad.text
    assert bad.step_reward == 0.0 and not bad.timed_out
    assert (good.text, good.step_reward, good.error) == ("2", 1.0, None)


@pytest.mark.unit
def test_hung_tool_is_cancelled_at_its_timeout():
    """Fault: a call running past `timeout_s` is cancelled (the tool sees CancelledError) and reported as a timeout."""

    async def behaviour(params):
        await asyncio.sleep(60)
        return "never", 0.0, {}

    runner = scripted(behaviour, timeout_s=0.2)
    result = asyncio.run(runner.execute("i", {"x": 1}))
    assert result.timed_out and result.error == "timeout"
    assert "timed out after 0.2s" in result.text
    assert runner.tool.cancelled == 1 and runner.tool.in_flight == 0


@pytest.mark.unit
def test_oversized_response_is_truncated_with_a_marker():
    """Fault: a 1 MB response is cut to `max_response_chars`, says how much was dropped, and is flagged."""

    async def behaviour(params):
        return "a" * 1_000_000, 0.5, {}

    runner = scripted(behaviour, max_response_chars=1000)
    result = asyncio.run(runner.execute("i", {"x": 1}))
    assert result.truncated and result.text.startswith("a" * 1000)
    assert result.text.endswith("[truncated 999000 chars]") and len(result.text) < 1100
    assert result.step_reward == 0.5 and result.response.text == result.text


@pytest.mark.unit
def test_invalid_arguments_never_reach_the_tool():
    """Arguments that do not fit the schema give an error response naming the argument; the tool is not called."""

    async def behaviour(params):
        return "ran", 0.0, {}

    runner = scripted(behaviour)
    result = asyncio.run(runner.execute("i", {"x": "seven"}))
    assert result.error.startswith("invalid_arguments") and "x: 'seven' is not of type 'integer'" in result.text
    assert runner.tool.calls == 0


@pytest.mark.unit
def test_bad_return_shape_is_reported_not_raised():
    """A tool whose execute returns the wrong shape gives an error response naming the expected shape."""

    async def behaviour(params):
        return "just a string"

    result = asyncio.run(scripted(behaviour).execute("i", {"x": 1}))
    assert result.error and "must return (response, step_reward, metrics)" in result.text


@pytest.mark.unit
def test_max_concurrency_bounds_calls_in_flight():
    """Per-tool `max_concurrency`: never more calls inside the tool at once, however many trajectories call it."""

    async def behaviour(params):
        await asyncio.sleep(0.02)
        return "ok", 0.0, {}

    runner = scripted(behaviour, max_concurrency=3)

    async def go():
        return await asyncio.gather(*(runner.execute(f"i{k}", {"x": k}) for k in range(12)))

    results = asyncio.run(go())
    assert all(r.error is None for r in results)
    assert runner.tool.max_in_flight == 3


@pytest.mark.unit
def test_rate_limit_spaces_call_starts():
    """Per-tool `rate_limit` (calls/s): five calls issued at once are spread over >= 4/rate seconds
    (checked with one interval of slack for event-loop wake-up jitter)."""

    async def behaviour(params):
        return "ok", 0.0, {}

    runner = scripted(behaviour, rate_limit=20.0)

    async def go():
        await asyncio.gather(*(runner.execute("i", {"x": k}) for k in range(5)))

    asyncio.run(go())
    starts = runner.tool.starts
    assert len(starts) == 5 and starts[-1] - starts[0] >= 3 * 0.05


@pytest.mark.unit
def test_release_is_called_when_the_trajectory_is_cancelled(tmp_path, user_package):
    """`release` is guaranteed: a trajectory cancelled mid-call (rollout abort) still releases its instance."""
    registry = ToolRegistry.from_config(
        {"tools": [{"class_name": "user_tools.CounterTool", "tool_schema": COUNTER_SCHEMA}]}
    )
    runner = registry.runner("counter")
    started = asyncio.Event()

    async def trajectory():
        async with runner.session() as iid:
            started.set()
            await asyncio.sleep(60)
            return iid

    async def go():
        tasks = [asyncio.create_task(trajectory()) for _ in range(4)]
        await started.wait()
        await asyncio.sleep(0.01)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.01)

    asyncio.run(go())
    assert registry.counts() == {"counter": (4, 4)}
    assert runner.live_instances == set()
    assert [e for e, _ in user_package.EVENTS].count("release") == 4


# ---------------------------------------------------------------- gsm8k


@pytest.mark.unit
def test_gsm8k_tool_feedback_and_rewards():
    """The GSM8K tool: wrong answer -> reward 0 and a -0.05 step penalty; correct -> reward 1, step 0;
    calc_reward is the best score; a missing ground truth is refused at create naming the kwarg."""
    registry = ToolRegistry.from_config(REPO / "tool_configs" / "gsm8k_tool_config.yaml")
    runner = registry.runner("calc_gsm8k_reward")

    async def go():
        async with runner.session(create_kwargs={"ground_truth": "72"}) as iid:
            wrong = await runner.execute(iid, {"answer": "70"})
            right = await runner.execute(iid, {"answer": "72"})
            again = await runner.execute(iid, {"answer": "72"})
            return wrong, right, again, await runner.calc_reward(iid)

    wrong, right, again, reward = asyncio.run(go())
    assert wrong.text == "Current parsed answer=70 reward=0.0" and wrong.step_reward == -0.05
    assert right.text == "Current parsed answer=72 reward=1.0" and right.step_reward == 0.0
    assert again.step_reward == -0.05 and reward == 1.0
    with pytest.raises(ValueError, match="create_kwargs.ground_truth"):
        asyncio.run(runner.create())
    assert registry.counts() == {"calc_gsm8k_reward": (1, 1)}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.unit
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.one_of(st.text(max_size=60), json_values.map(json.dumps), json_values))
def test_malformed_calls_never_raise_and_never_reach_the_tool_with_bad_arguments(raw):
    """Fuzz (1,000 cases): whatever arguments a model emits (broken JSON, wrong types, non-objects), decoding
    and running the call returns a result; the tool only ever sees arguments that fit its schema."""
    seen = []

    async def behaviour(params):
        seen.append(params)
        return "ok", 0.0, {}

    runner = scripted(behaviour)
    call, decode_error = OpenAIFunctionCallSchema.from_raw(
        "t", raw if isinstance(raw, (str, dict)) else json.dumps(raw)
    )
    result = asyncio.run(runner.execute("i", call.arguments if decode_error is None else raw))
    assert isinstance(result.text, str) and result.text
    for params in seen:
        assert runner.schema.check_arguments(params) == (params, [])
        assert isinstance(params, dict) and ("x" not in params or type(params["x"]) is int)
    if result.error is None:
        assert seen and result.text == "ok"
