"""A data row's `agent_name` (verl's) picks its agent loop: `tool_agent` rows get the multi-turn loop with their
tools, `single_turn_agent` rows one assistant turn with no tools offered and no simulated user; rows without it get
`actor_rollout_ref.rollout.agent.default_agent_loop`, and any other name is refused when the data loads, in one
line naming the row's value and what polyturn runs."""
from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipe.data.dataset import RLDataset
from rollout.config import RolloutConfig
from rollout.interactions.registry import InteractionRegistry
from rollout.prompt import RolloutPrompt
from rollout.tools.registry import ToolRegistry
from rollout.trajectory import FinishReason
from tests.test_agent_loop import AddTool, ScriptedEngine, ScriptedUser, _call, _loop, tokenizer  # noqa: F401

pytestmark = pytest.mark.unit

QUESTION = [{"role": "user", "content": "What is 2 plus 3?"}]


def _rows(tmp_path, *agent_names):
    """A parquet file of one row per agent name (None: the row has no agent_name column value)."""
    rows = [{"data_source": "d", "prompt": QUESTION, "agent_name": a,
             "extra_info": {"tools_kwargs": {"add": {"create_kwargs": {"seed": 1}}},
                            "interaction_kwargs": {"name": "scripteduser", "answer": "5"}}}
            for a in agent_names]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _dataset(path, default_agent="tool_agent", tokenizer=None):
    return RLDataset([path], ToolRegistry([AddTool()]), InteractionRegistry([ScriptedUser()]),
                     tokenizer=tokenizer, default_agent=default_agent)


def test_single_turn_rows_get_no_tools_and_one_turn(tokenizer, tmp_path):
    """Contract: a single_turn_agent row's prompt offers no tools, its one assistant turn ends the trajectory even
    when it writes a tool call, and no tool or simulated user is started; a tool_agent row gets its tools."""
    ds = _dataset(_rows(tmp_path, "single_turn_agent", "tool_agent"), tokenizer=tokenizer)
    single, multi = ds.items
    assert (single.agent_name, single.tools_kwargs, single.interaction_kwargs) == ("single_turn_agent", {}, {})
    assert '"name": "add"' not in tokenizer.decode(single.prompt_ids)
    assert '"name": "add"' in tokenizer.decode(multi.prompt_ids)
    policy = lambda uid, turn: [_call("add", a=2, b=3), "The answer is 5."][turn]
    tool, user = AddTool(), ScriptedUser()
    out = asyncio.run(_loop(tokenizer, ScriptedEngine(tokenizer, policy), [tool], [user]).generate(ds.items))
    one, many = out
    assert one.finish_reason is FinishReason.STOP and [s.role for s in one.turns] == ["assistant"]
    assert one.tool_names == [] and one.tool_calls == [] and one.interaction_scores == []
    assert [s.role for s in many.turns][:3] == ["assistant", "tool", "assistant"] and many.tool_calls
    assert len(tool.created) == 1 and len(user.started) == 1  # the tool_agent row's only


def test_rows_without_agent_name_get_the_default(tmp_path):
    """Contract: agent.default_agent_loop applies to rows without agent_name (absent or null), not to rows with one."""
    path = _rows(tmp_path, None, "tool_agent")
    assert [p.agent_name for p in _dataset(path).items] == ["tool_agent", "tool_agent"]
    assert [p.agent_name for p in _dataset(path, "single_turn_agent").items] == ["single_turn_agent", "tool_agent"]
    assert RolloutPrompt.from_row({"prompt": QUESTION}, uid="r").agent_name == "tool_agent"


def test_unknown_agent_name_is_refused_in_one_line(tmp_path):
    """Contract: a row naming another agent loop (a custom verl one) stops the data load in one line naming the row,
    its value and the loops polyturn runs."""
    path = _rows(tmp_path, "tool_agent", "my_react_agent")
    with pytest.raises(ValueError) as err:
        _dataset(path)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{path}[1]: agent_name='my_react_agent'")
    assert "tool_agent" in line and "single_turn_agent" in line


def test_default_agent_loop_is_a_checked_key():
    """Contract: agent.default_agent_loop is a polyturn key (no longer warned as having no effect): checked, and the
    rest of verl's agent.* section is still warned."""
    from recipe.launch import prepare

    assert RolloutConfig(agent={"default_agent_loop": "single_turn_agent"}).agent.default_agent_loop == \
        "single_turn_agent"
    with pytest.raises(ValueError, match="default_agent_loop='react'"):
        RolloutConfig(agent={"default_agent_loop": "react"})
    launch = prepare(["actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent",
                      "actor_rollout_ref.rollout.agent.num_workers=8"])
    assert launch.overrides == ["actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent"]
    assert [w.split("=")[0].split(" ")[0] for w in launch.warned] == ["actor_rollout_ref.rollout.agent.num_workers"]
