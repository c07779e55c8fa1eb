"""verl's plug-ins as they are: verl's YAML byte for byte, verl's class paths, classes written against verl's
own base files (copied under tests/verl_files/verl_copy), both kwargs shapes, arguments read as verl's tools
read them, and `rollout_trace_op` recording into the trajectory."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rollout.interactions.registry import InteractionRegistry
from recipe.tasks import gsm8k, verl_aliases
from rollout.plugins import VERL_ALIASES, PluginConfigError, added_aliases, import_object
from rollout.tool_parser import MalformedCall, ParsedCall, ToolCallParser
from rollout.tools.gsm8k_tool import Gsm8kTool
from rollout.tools.registry import ToolRegistry
from rollout.tools.schemas import OpenAIFunctionToolSchema
from rollout.tracing import rollout_trace_op, trace_into
from tests.verl_files.verl_copy.interactions.base import (
    BaseInteraction as VerlBaseInteraction,
)
from tests.verl_files.verl_copy.tools.base_tool import BaseTool as VerlBaseTool
from tests.verl_files.verl_copy.tools.schemas import ToolResponse as VerlToolResponse

VERL_FILES = Path(__file__).resolve().parent / "verl_files"
VERL_TOOL_YAML = VERL_FILES / "gsm8k_tool_config.yaml"
VERL_INTERACTION_YAML = VERL_FILES / "gsm8k_interaction_config.yaml"


def tool_entry(cls: str, properties: dict[str, Any] | None = None, **config: Any) -> dict[str, Any]:
    props = properties or {"answer": {"type": "string"}}
    return {"class_name": cls, "config": {"type": "native", **config},
            "tool_schema": {"type": "function", "function": {"name": "t", "description": "d", "parameters": {
                "type": "object", "properties": props, "required": list(props)}}}}


def runner_of(cls: str, properties: dict[str, Any] | None = None, **config: Any):
    return ToolRegistry.from_config({"tools": [tool_entry(cls, properties, **config)]}).runner("t")


# ---------------------------------------------------------------- class paths, verl's YAML


@pytest.mark.unit
def test_verl_yaml_loads_unchanged_with_the_gsm8k_scorer_by_default():
    """Contract: verl's gsm8k tool and interaction YAML (byte-for-byte copies) load as they are: verl's class paths
    resolve to polyturn's classes through VERL_ALIASES, `config: {type: native}` / `config: {}` get verl's scorer
    path, which the recipe's aliases (as main_ppo passes them) map onto the GSM8K task's scorer, and the tool scores
    verl's way ({"answer": 72} as a number counts, as verl's str() does)."""
    assert "verl.tools.gsm8k_tool.Gsm8kTool" in VERL_TOOL_YAML.read_text()
    tools = ToolRegistry.from_config(VERL_TOOL_YAML, aliases=verl_aliases())
    interactions = InteractionRegistry.from_config(VERL_INTERACTION_YAML, aliases=verl_aliases())
    assert tools.runner("calc_gsm8k_reward").tool.score_fn is gsm8k.compute_score
    assert interactions.runner("gsm8k").plugin.score_fn is gsm8k.compute_score
    assert tools.names == ["calc_gsm8k_reward"] and interactions.names == ["gsm8k"]
    assert type(tools.runner("calc_gsm8k_reward").tool) is Gsm8kTool

    async def run():
        tool = tools.runner("calc_gsm8k_reward")
        (call,) = ToolCallParser([tool.schema]).parse(
            '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": 72}}</tool_call>').calls
        assert isinstance(call, ParsedCall) and call.arguments == {"answer": "72"}
        async with tool.session({"ground_truth": "72"}) as iid:
            result = await tool.execute(iid, call.arguments)
            reward = await tool.calc_reward(iid)
        user = interactions.runner("gsm8k")
        async with user.session(ground_truth="72") as iid:
            wrong = await user.respond(iid, [{"role": "assistant", "content": "#### 71"}])
            right = await user.respond(iid, [{"role": "assistant", "content": "#### 72"}])
        return result, reward, wrong, right

    result, reward, wrong, right = asyncio.run(run())
    assert result.error is None and result.text == "Current parsed answer=72 reward=1.0" and reward == 1.0
    assert (wrong.should_terminate, wrong.score, right.should_terminate, right.score) == (False, 0.0, True, 1.0)


@pytest.mark.unit
def test_every_alias_resolves_and_an_unknown_verl_path_names_the_table():
    """Contract: each entry of the one alias table imports; a verl path with no counterpart (verl not installed)
    is refused naming VERL_ALIASES, so the user sees what exists."""
    for verl_path in VERL_ALIASES:
        assert import_object(verl_path, "test") is import_object(VERL_ALIASES[verl_path], "test")
    for verl_path, ours in verl_aliases().items():
        with added_aliases(verl_aliases()):
            assert import_object(verl_path, "test") is import_object(ours, "test")
    with pytest.raises(PluginConfigError, match=r"tools\[0\]\.class_name: verl\.tools\.geo3k_tool\.Geo3kTool is a verl "
                                                r"path with no polyturn counterpart.*rollout\.plugins\.VERL_ALIASES"):
        ToolRegistry.from_config({"tools": [tool_entry("verl.tools.geo3k_tool.Geo3kTool")]})


@pytest.mark.unit
def test_verls_sandbox_fusion_yaml_runs_code_in_the_local_sandbox(caplog):
    """Contract: verl's sandbox_fusion_tool_config.yaml (byte for byte) loads; its keys become the python tool's
    (default_timeout -> timeout_s, memory_limit_mb -> memory_mb, rate_limit / num_workers -> calls in flight, not
    calls per second); the unused service URL is named in a warning; a non-python language is refused."""
    with caplog.at_level("WARNING", logger="rollout.tools.sandbox_fusion"):
        runner = ToolRegistry.from_config(VERL_FILES / "sandbox_fusion_tool_config.yaml").runner("code_interpreter")
    assert "sandbox_fusion_url is not used" in caplog.text
    assert (runner.limits.timeout_s, runner.limits.max_concurrency, runner.limits.rate_limit) == (30.0, 10, None)
    assert runner.tool.sandbox.limits.memory_mb == 1024

    async def run():
        async with runner.session() as iid:
            return await runner.execute(iid, {"code": "print(6 * 7)"})

    result = asyncio.run(run())
    assert result.error is None and "42" in result.text
    entry = tool_entry("verl.tools.sandbox_fusion_tools.SandboxFusionTool", {"code": {"type": "string"}},
                       default_language="nodejs")
    with pytest.raises(PluginConfigError, match=r"config\.default_language='nodejs'.*set default_language: python"):
        ToolRegistry.from_config({"tools": [entry]})


# ---------------------------------------------------------------- classes on verl's own base files


class VerlStyleTool(VerlBaseTool):
    """Written as for verl: verl's BaseTool and ToolResponse, ground truth read flat, create returns (id, response)."""

    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)  # verl's base calls tool_schema.model_dump(...)
        self.state: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id, response = await super().create(instance_id, **kwargs)
        self.state[instance_id] = {"ground_truth": ground_truth, "calls": 0}
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        self.state[instance_id]["calls"] += 1
        right = parameters["answer"] == self.state[instance_id]["ground_truth"]
        return VerlToolResponse(text=f"{parameters['answer']} is {'right' if right else 'wrong'}"), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return float(self.state[instance_id]["calls"])

    async def release(self, instance_id, **kwargs):
        del self.state[instance_id]


class VerlStyleInteraction(VerlBaseInteraction):
    """verl's BaseInteraction with verl's base `calculate_score(self)` / `finalize_interaction(self)` kept."""

    async def generate_response(self, instance_id, messages, **kwargs):
        return True, f"seen {len(messages)}", 0.5, {}


@pytest.mark.unit
def test_plugins_written_against_verls_base_files_build_and_run():
    """Contract: a tool subclassing verl's BaseTool (verl's base and schema files, copied) builds from YAML and runs
    its whole lifecycle; verl's base `execute` decorator records into the active trajectory; an interaction on
    verl's BaseInteraction runs with verl's no-argument calculate_score / finalize_interaction."""
    runner = runner_of(f"{__name__}.VerlStyleTool")
    assert isinstance(runner.tool, VerlBaseTool) and runner.tool.tool_schema.model_dump()["function"]["name"] == "t"
    user = InteractionRegistry.from_config(
        {"interaction": [{"name": "judge", "class_name": f"{__name__}.VerlStyleInteraction", "config": {}}]}
    ).runner("judge")

    async def run():
        async with runner.session({"ground_truth": "7"}) as iid:
            ok = await runner.execute(iid, {"answer": 7})
            reward = await runner.calc_reward(iid)
        async with user.session() as iid:
            turn = await user.respond(iid, [{"role": "user", "content": "hi"}])
            score = await user.calculate_score(iid)
        return ok, reward, turn, score

    ok, reward, turn, score = asyncio.run(run())
    assert ok.error is None and ok.text == "7 is right" and reward == 1.0
    assert runner.tool.state == {} and runner.num_opened == runner.num_closed == 1
    assert (turn.should_terminate, turn.text, turn.score, score) == (True, "seen 1", 0.5, 0.0)
    assert user.num_opened == user.num_closed == 1

    base_runner = runner_of("tests.verl_files.verl_copy.tools.base_tool.BaseTool")
    records: list[dict[str, Any]] = []

    async def traced():
        with trace_into(records):
            async with base_runner.session() as iid:
                return await base_runner.execute(iid, {"answer": "x"})

    assert asyncio.run(traced()).text == "Updated the tool state."
    (record,) = records
    assert record["name"] == "BaseTool.execute" and record["args"][1] == {"answer": "x"}
    assert record["result"] == [{"text": "Updated the tool state."}, 0.0, {}] and record["duration_s"] >= 0


@pytest.mark.unit
def test_rollout_trace_op_records_calls_on_the_active_trajectory_only():
    """Contract: a decorated call (sync or async, failing or not) is recorded with name, arguments, result and
    duration in the records of the context it runs in, concurrent trajectories apart; outside one, nothing."""

    class Thing:
        @rollout_trace_op
        async def work(self, x, *, y=0):
            await asyncio.sleep(0)
            if x < 0:
                raise ValueError("negative")
            return {"sum": x + y}

    @rollout_trace_op
    def double(x):
        return 2 * x

    thing, a, b = Thing(), [], []

    async def one(records, x):
        with trace_into(records):
            await thing.work(x, y=1)
            double(x)
            with pytest.raises(ValueError):
                await thing.work(-1)

    async def both():
        await asyncio.gather(one(a, 1), one(b, 2))
        await thing.work(5)  # no active trajectory

    asyncio.run(both())
    for records, x in ((a, 1), (b, 2)):
        assert [(r["name"], r["args"], r["kwargs"], r["result"]) for r in records] == [
            ("test_rollout_trace_op_records_calls_on_the_active_trajectory_only.<locals>.Thing.work", [x], {"y": 1},
             {"sum": x + 1}),
            ("test_rollout_trace_op_records_calls_on_the_active_trajectory_only.<locals>.double", [x], {}, 2 * x),
            ("test_rollout_trace_op_records_calls_on_the_active_trajectory_only.<locals>.Thing.work", [-1], {}, None)]
        assert records[2]["error"] == "ValueError: negative" and "error" not in records[0]
        json.dumps(records)  # plain JSON, for the dump


# ---------------------------------------------------------------- both kwargs shapes


class ShapeTool:
    """Duck-typed tool recording what each method received; subclasses pick the signatures."""

    def __init__(self, config, tool_schema):
        self.config, self.tool_schema, self.seen = config, tool_schema, []

    def get_openai_tool_schema(self):
        return self.tool_schema


class BothTool(ShapeTool):
    async def create(self, instance_id=None, **kwargs):
        self.seen.append(("create", kwargs))
        return "i"

    async def execute(self, instance_id, parameters, **kwargs):
        self.seen.append(("execute", kwargs))
        return "ok", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        self.seen.append(("calc_reward", kwargs))
        return 1.0

    async def release(self, instance_id, **kwargs):
        self.seen.append(("release", kwargs))


class NestedTool(ShapeTool):
    async def create(self, create_kwargs=None):
        self.seen.append(("create", create_kwargs))
        return "i"

    async def execute(self, instance_id, parameters, execute_kwargs=None):
        self.seen.append(("execute", execute_kwargs))
        return "ok", 0.0, {}

    async def calc_reward(self, instance_id, calc_reward_kwargs=None):
        self.seen.append(("calc_reward", calc_reward_kwargs))
        return 1.0

    async def release(self, instance_id, release_kwargs=None):
        self.seen.append(("release", release_kwargs))


class FlatTool(ShapeTool):
    async def create(self, ground_truth):
        self.seen.append(("create", ground_truth))
        return "i"

    async def execute(self, instance_id, parameters, hint=None):
        self.seen.append(("execute", hint))
        return "ok", 0.0, {}

    async def calc_reward(self, instance_id, scale=1.0):
        self.seen.append(("calc_reward", scale))
        return scale

    async def release(self, instance_id, reason="done"):
        self.seen.append(("release", reason))


class NoInstanceTool(BothTool):
    async def release(self):  # cannot take the instance id: no shape works
        pass


@pytest.mark.unit
def test_tool_methods_get_the_kwargs_shape_their_signature_asks_for():
    """Contract: with **kwargs a method gets the sample's kwargs flat AND under `<method>_kwargs=`; otherwise the
    nested dict when it names that parameter, else the keys flat; a tool that can take neither is refused at
    load, naming the tool and the method."""
    kw = {"create_kwargs": {"ground_truth": "3"}, "execute_kwargs": {"hint": "h"},
          "calc_reward_kwargs": {"scale": 2.0}, "release_kwargs": {"reason": "r"}}

    def run(cls):
        runner = runner_of(f"{__name__}.{cls}")

        async def go():
            async with runner.session(kw["create_kwargs"], kw["release_kwargs"]) as iid:
                await runner.execute(iid, {"answer": "1"}, **kw["execute_kwargs"])
                reward = await runner.calc_reward(iid, **kw["calc_reward_kwargs"])
            return reward

        return runner, asyncio.run(go())

    both, reward = run("BothTool")
    assert both.shapes == dict.fromkeys(("create", "execute", "calc_reward", "release"), "both") and reward == 1.0
    assert both.tool.seen == [(m, {**kw[f"{m}_kwargs"], f"{m}_kwargs": kw[f"{m}_kwargs"]})
                              for m in ("create", "execute", "calc_reward", "release")]
    nested, _ = run("NestedTool")
    assert set(nested.shapes.values()) == {"nested"}
    assert nested.tool.seen == [(m, kw[f"{m}_kwargs"]) for m in ("create", "execute", "calc_reward", "release")]
    flat, reward = run("FlatTool")
    assert set(flat.shapes.values()) == {"flat"} and reward == 2.0
    assert flat.tool.seen == [("create", "3"), ("execute", "h"), ("calc_reward", 2.0), ("release", "r")]
    with pytest.raises(PluginConfigError, match=r"tools\[0\]: tool 't': NoInstanceTool\.release cannot be called "
                                                r"as verl calls it, with \(instance_id\)"):
        runner_of(f"{__name__}.NoInstanceTool")


# ---------------------------------------------------------------- arguments as verl's tools take them


@pytest.mark.unit
def test_arguments_are_read_as_verls_tools_read_them():
    """Contract: a number for a string field becomes its text; an integral string for an integer field becomes the
    integer; bool / null / containers for a scalar stay bad_arguments; `arguments` as a JSON string holding an
    object is decoded; `config.strict_arguments: true` validates the arguments as written instead."""
    props = {"answer": {"type": "string"}, "count": {"type": "integer"}}
    lenient = runner_of(f"{__name__}.BothTool", props).schema
    strict = runner_of(f"{__name__}.BothTool", props, strict_arguments=True).schema
    assert not lenient.strict_arguments and strict.strict_arguments

    def parse(schema, arguments: str):
        (call,) = ToolCallParser([schema]).parse(f'<tool_call>{{"name": "t", "arguments": {arguments}}}</tool_call>').calls
        return call.arguments if isinstance(call, ParsedCall) else call.kind

    assert parse(lenient, '{"answer": 18, "count": "3"}') == {"answer": "18", "count": 3}
    assert parse(lenient, '{"answer": 2.5, "count": "-4"}') == {"answer": "2.5", "count": -4}
    assert parse(lenient, '{"answer": "1", "count": 3.0}') == parse(strict, '{"answer": "1", "count": 3.0}') == {
        "answer": "1", "count": 3}
    assert parse(lenient, json.dumps(json.dumps({"answer": "x", "count": 1}))) == {"answer": "x", "count": 1}
    for bad in ('{"answer": true, "count": 1}', '{"answer": null, "count": 1}', '{"answer": ["1"], "count": 1}',
                '{"answer": {"a": 1}, "count": 1}', '{"answer": "1", "count": "3.5"}', '{"answer": "1", "count": 2.5}',
                '{"answer": "1", "count": false}', '{"answer": "1"}', json.dumps(json.dumps([1]))):
        assert parse(lenient, bad) == "bad_arguments", bad
    assert parse(strict, '{"answer": 18, "count": 3}') == "bad_arguments"
    assert parse(strict, '{"answer": "18", "count": "3"}') == "bad_arguments"
    assert parse(strict, '{"answer": "18", "count": 3}') == {"answer": "18", "count": 3}


@pytest.mark.unit
@pytest.mark.parametrize("strict", [False, True])
def test_deeply_nested_arguments_are_bad_arguments_not_a_crash(strict):
    """Contract: no input makes the parser or the runner raise: 990-deep nested arguments (past the JSON-schema
    validator's recursion) are bad_arguments, whatever the schema and mode."""
    schema = OpenAIFunctionToolSchema.from_dict({"type": "function", "function": {
        "name": "t", "description": "d", "parameters": {"type": "object", "properties": {
            "answer": {"type": "string"}, "data": {"type": "object", "additionalProperties": {"$ref": "#"}}}}}})
    schema = schema.with_strict_arguments(strict)
    deep = '{"a": ' * 990 + "1" + "}" * 990
    (call,) = ToolCallParser([schema]).parse(
        f'<tool_call>{{"name": "t", "arguments": {{"data": {deep}}}}}</tool_call>').calls
    assert isinstance(call, MalformedCall) and call.kind == "bad_arguments" and "nested deeper than" in call.message
    nested: dict[str, Any] = {"a": 1}
    for _ in range(989):
        nested = {"a": nested}
    _, errors = schema.check_arguments({"data": nested})  # a tool call given decoded arguments
    assert errors == ["arguments: nested deeper than 64 levels"]


@pytest.mark.unit
def test_readme_examples_of_a_tool_and_an_interaction_run(monkeypatch):
    """Contract: the worked examples of docs/tools-and-interactions.md load from YAML and run as the text says."""
    import re
    import sys
    import types

    page = (Path(__file__).resolve().parents[1] / "docs" / "tools-and-interactions.md").read_text()
    section = page[page.index("## Worked examples"):]
    module = types.ModuleType("readme_plugins")
    exec("\n".join(re.findall(r"```python\n(.*?)```", section, re.DOTALL)), module.__dict__)  # noqa: S102
    monkeypatch.setitem(sys.modules, "readme_plugins", module)
    tool = ToolRegistry.from_config({"tools": [{
        "class_name": "readme_plugins.UnitConverter", "config": {"type": "native"},
        "tool_schema": {"type": "function", "function": {"name": "convert", "description": "d", "parameters": {
            "type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}}}}]}).runner("convert")
    echo = InteractionRegistry.from_config(
        {"interaction": [{"name": "echo", "class_name": "readme_plugins.Echo", "config": {}}]}).runner("echo")

    async def run():
        records: list[dict[str, Any]] = []
        with trace_into(records):
            async with tool.session({"factor": 2.5}) as iid:
                result = await tool.execute(iid, {"value": 4})
        async with echo.session(target="42") as iid:
            turns = [await echo.respond(iid, [{"role": "assistant", "content": c}]) for c in ("41", "it is 42")]
        return result, records, turns

    result, records, turns = asyncio.run(run())
    assert result.text == "10.0" and [r["name"] for r in records] == ["UnitConverter.execute"]
    assert [(t.should_terminate, t.text, t.score) for t in turns] == [(False, "Try again.", 0.0), (True, "Good.", 1.0)]
    assert tool.tool.factors == {} and echo.plugin.targets == {}


# ---------------------------------------------------------------- verl's YAML on the CPU SGLang engine


@pytest.mark.integration
def test_verls_gsm8k_yaml_drive_a_multi_turn_rollout_on_sglang(sglang_engine, tiny_model_dir):
    """Contract: verl's gsm8k_tool_config.yaml and gsm8k_interaction_config.yaml, byte for byte, drive a multi-turn
    rollout on the real engine: the model's tool call (answer written as a JSON number) reaches verl's gsm8k tool
    as text and scores 1.0, the interaction replies and then accepts, and the tool's traced `execute` call is on
    the trajectory's record."""
    from transformers import AutoTokenizer

    from rollout.agent_loop import AgentLoop
    from rollout.prompt import RolloutPrompt
    from rollout.config import MultiTurnConfig, RolloutConfig
    from rollout.trajectory import FinishReason
    from tests.test_agent_loop_sglang import (
        RIGHT_ANSWER,
        WRONG_ANSWER,
        RegexSteeredEngine,
    )

    tool_call = r'<tool_call>\n\{"name": "calc_gsm8k_reward", "arguments": \{"answer": 72\}\}\n</tool_call>'
    steered = RegexSteeredEngine(sglang_engine, [tool_call, WRONG_ANSWER, RIGHT_ANSWER])
    config = RolloutConfig(n=1, response_length=400, temperature=1.0, multi_turn=MultiTurnConfig(
        tool_config_path=str(VERL_TOOL_YAML), interaction_config_path=str(VERL_INTERACTION_YAML),
        max_assistant_turns=4, max_user_turns=2))
    loop = AgentLoop([steered], AutoTokenizer.from_pretrained(str(tiny_model_dir)), config,
                     ToolRegistry.from_config(VERL_TOOL_YAML, aliases=verl_aliases()),
                     InteractionRegistry.from_config(VERL_INTERACTION_YAML, aliases=verl_aliases()))
    row = {"data_source": "openai/gsm8k",
           "prompt": [{"role": "user", "content": "Tom has 8 boxes with 9 apples each. How many apples?"}],
           "reward_model": {"style": "rule", "ground_truth": "72"},
           "extra_info": {"index": 0, "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
                          "interaction_kwargs": {"name": "gsm8k", "ground_truth": "72"}}}
    (traj,) = asyncio.run(loop.generate([RolloutPrompt.from_row(row, uid="v0")]))
    assert traj.finish_reason is FinishReason.STOP, traj.error
    assert [s.role for s in traj.turns] == ["assistant", "tool", "assistant", "user", "assistant"]
    (call,) = traj.tool_calls
    assert call.error is None and call.arguments == {"answer": "72"}
    assert call.result == "Current parsed answer=72 reward=1.0" and traj.tool_rewards == {"calc_gsm8k_reward": 1.0}
    assert [(s.turn, s.score) for s in traj.interaction_scores] == [(1, 0.0), (2, 1.0)]
    (trace,) = traj.traces
    assert trace["name"] == "Gsm8kTool.execute" and trace["args"][1] == {"answer": "72"}
    assert trace["result"][0] == {"text": "Current parsed answer=72 reward=1.0"}
    assert loop.instance_metrics()["rollout/tool/calc_gsm8k_reward/instances_live"] == 0
