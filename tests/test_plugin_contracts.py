"""Plug-in contract: a tool and an interaction written exactly as verl's documentation shows (verl's base
signatures, verl's pydantic ToolResponse, no polyturn base class), configured with verl's YAML (a native
tool entry, an `mcp:` entry, an interaction entry without `name:`), run unchanged through the agent loop.

verl itself is not installed here: the user module mirrors the two small verl pieces such code imports
(`ToolResponse`, a pydantic model; `OpenAIFunctionToolSchema` is only read through `.function.name`)."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from pathlib import Path

import pytest
import yaml

from rollout.interactions.registry import InteractionRegistry
from rollout.prompt import RolloutPrompt
from rollout.tools.registry import ToolRegistry
from tests.test_agent_loop import ScriptedEngine, _call, _loop, tokenizer  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

SERVER = Path(__file__).with_name("mcp_server_for_tests.py")

VERL_STYLE_MODULE = '''
from typing import Any, Optional
from uuid import uuid4

from pydantic import BaseModel

EVENTS = []


class ToolResponse(BaseModel):  # verl.tools.schemas.ToolResponse
    text: Optional[str] = None
    image: Optional[list[Any]] = None
    video: Optional[list[Any]] = None


class AnswerCheckTool:  # as verl's Gsm8kTool: verl's BaseTool signatures, no polyturn base class
    def __init__(self, config: dict, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
        self._instance_dict = {}

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"ground_truth": ground_truth, "reward": 0.0}
        EVENTS.append(("create", self.name, kwargs))
        return instance_id, ToolResponse(text="Checker ready.")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = str(parameters.get("answer", ""))
        reward = 1.0 if answer == self._instance_dict[instance_id]["ground_truth"] else 0.0
        self._instance_dict[instance_id]["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer} reward={reward}"), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return self._instance_dict[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs) -> None:
        EVENTS.append(("release", self.name))
        del self._instance_dict[instance_id]


class DictTool(AnswerCheckTool):  # verl's BaseTool.execute default: a dict response
    async def create(self, instance_id: Optional[str] = None, **kwargs) -> str:
        return instance_id or str(uuid4())

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        return {"text": "Updated the tool state."}, 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        EVENTS.append(("release", self.name))


class TeacherInteraction:  # verl's BaseInteraction signatures, calculate_score/finalize without arguments
    def __init__(self, config: dict):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: Optional[str] = None, **kwargs) -> str:
        EVENTS.append(("start", self.name, kwargs.get("ground_truth")))
        return instance_id or str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs):
        done = kwargs["ground_truth"] in messages[-1]["content"]
        return done, "Correct!" if done else "Try again.", 1.0 if done else 0.0, {}

    async def calculate_score(self) -> float:
        return 0.5

    async def finalize_interaction(self) -> None:
        EVENTS.append(("finalize", self.name))
'''


def _schema(name: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} tool",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": []}}}


@pytest.fixture
def verl_user(tmp_path, monkeypatch):
    (tmp_path / "verl_user.py").write_text(VERL_STYLE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("verl_user", None)
    servers = tmp_path / "mcp_servers.json"
    servers.write_text(json.dumps({"mcpServers": {"test": {"command": sys.executable, "args": [str(SERVER)]}}}))
    tools = {"tools": [
        {"class_name": "verl_user.AnswerCheckTool", "config": {"type": "native"}, "tool_schema": _schema("check")},
        {"class_name": "verl_user.DictTool", "config": {"type": "native"}, "tool_schema": _schema("note")},
        {"class_name": "rollout.tools.mcp_tool.MCPTool", "config": {"type": "mcp", "timeout_s": 30},
         "mcp": {"mcp_servers_config_path": "mcp_servers.json", "tool_selected_list": ["add"]}},
    ]}
    (tmp_path / "tools.yaml").write_text(yaml.safe_dump(tools))
    (tmp_path / "interaction.yaml").write_text(
        yaml.safe_dump({"interaction": [{"class_name": "verl_user.TeacherInteraction", "config": {}}]}))
    return importlib.import_module("verl_user"), tmp_path


def test_verl_documented_tool_and_interaction_run_unchanged_through_the_agent_loop(tokenizer, verl_user):  # noqa: F811
    """Contract: verl-written classes + verl YAML run unchanged: the create response, a pydantic ToolResponse and a
    dict response reach the model; create gets verl's `create_kwargs=`; the `mcp:` tool answers; the interaction
    gets verl's default name, `calculate_score(self)` gives its score and `finalize_interaction(self)` runs."""
    module, root = verl_user
    tools = ToolRegistry.from_config(root / "tools.yaml")
    interactions = InteractionRegistry.from_config(root / "interaction.yaml")
    assert tools.names == ["check", "note", "add"] and interactions.names == ["teacher"]
    script = [_call("check", answer="5") + _call("note") + _call("add", a=2, b=3), "It is 4.", "It is 5."]
    engine = ScriptedEngine(tokenizer, lambda uid, turn: script[turn])
    loop = _loop(tokenizer, engine, multi_turn={"max_user_turns": 3})
    loop.tools, loop.interactions = tools, interactions
    prompt = RolloutPrompt(uid="v", messages=[{"role": "user", "content": "2 + 3?"}],
                           tools_kwargs={"check": {"create_kwargs": {"ground_truth": "5"}}, "note": {}, "add": {}},
                           interaction_kwargs={"name": "teacher", "ground_truth": "5"})

    async def go():
        out = await loop.generate([prompt])
        score = await interactions.runner("teacher").calculate_score("any")
        await tools.aclose()
        return out, score

    (traj,), score = asyncio.run(asyncio.wait_for(go(), 120))
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_msgs == ["Checker ready.\nCurrent parsed answer=5 reward=1.0", "Updated the tool state.", "5"]
    assert [m["content"] for m in traj.messages if m["role"] == "user"][1:] == ["Try again."]
    assert [t.score for t in traj.interaction_scores] == [0.0, 1.0]
    assert traj.tool_rewards["check"] == 1.0 and score == 0.5
    assert ("create", "check", {"create_kwargs": {"ground_truth": "5"}}) in module.EVENTS
    assert ("start", "teacher", "5") in module.EVENTS and ("finalize", "teacher") in module.EVENTS
    assert {e for e in module.EVENTS if e[0] == "release"} == {("release", "check"), ("release", "note")}
    assert tools.counts()["check"] == (1, 1) and interactions.counts() == {"teacher": (1, 1)}
