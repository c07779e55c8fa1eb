"""Fuzz of the whole tool-call path with malformed model outputs (hypothesis).

Each example is one assistant turn's text built from fragments a broken policy writes: call
tags (opened, closed, doubled, missing), valid and broken JSON, known and unknown tool names,
arguments of the wrong type, lists, deep nesting, stray unicode. It goes through the real
path: tiny tokenizer -> `ScriptedEngine` (stand-in at the engine seam, from
`test_agent_loop`) -> the loop's SGLang parser -> tool runner -> chat-template delta -> mask.
"""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.tool_parser import ToolCallParser
from rollout.trajectory import FinishReason
from tests.test_agent_loop import AddTool, ScriptedEngine, _loop, _prompt

pytestmark = pytest.mark.unit

_names = st.sampled_from(["add", "Add", "mul", "", "add ", "ad\u00efd", "null"])
_values = st.one_of(st.integers(-10**12, 10**12), st.text(max_size=8), st.none(), st.booleans(),
                    st.floats(allow_nan=False), st.lists(st.integers(), max_size=3))
_args = st.one_of(
    st.fixed_dictionaries({"a": _values, "b": _values}),
    st.dictionaries(st.sampled_from(["a", "b", "c", "x"]), _values, max_size=4),
    _values,
)
_call_obj = st.one_of(
    st.builds(lambda n, a: {"name": n, "arguments": a}, _names, _args),
    st.builds(lambda n: {"name": n}, _names),
    st.builds(lambda a: {"arguments": a}, _args),
    _values,
)
_json_body = st.one_of(
    st.builds(json.dumps, _call_obj),
    st.builds(lambda objs: json.dumps(objs), st.lists(_call_obj, max_size=3)),
    st.builds(lambda s, k: s[: max(k, 0)], st.builds(json.dumps, _call_obj), st.integers(0, 40)),  # cut-off JSON
    st.sampled_from(["{", "}", '{"name": "add", "arguments": {"a": 1, "b": 2}', "[" * 3000, "{not json}", "",
                     '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', "NaN", '{"name": 1}']),
)
_fragment = st.one_of(
    st.builds(lambda b: f"<tool_call>\n{b}\n</tool_call>", _json_body),
    st.builds(lambda b: f"<tool_call>{b}</tool_call>", _json_body),
    st.builds(lambda b: f"<tool_call>\n{b}", _json_body),  # never closed
    st.sampled_from(["<tool_call>", "</tool_call>", "\n", "<tool_response>", "<|im_start|>", "\u200b", "\ud7ff"]),
    st.text(max_size=20),
)
_outputs = st.lists(_fragment, min_size=1, max_size=5).map("".join)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_fuzz_malformed_outputs_never_crash_the_loop(tokenizer):
    """Contract: >= 1,000 malformed assistant outputs each give a finished trajectory whose every call attempt is
    answered (result or tool-role error), whose mask is 1 exactly on engine ids, with every tool instance released."""
    tool = AddTool()
    seen = {"examples": 0, "errors": 0, "ok_calls": 0}

    @settings(max_examples=1000, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(text=_outputs)
    def run(text: str) -> None:
        engine = ScriptedEngine(tokenizer, lambda uid, turn: [text, "done"][min(turn, 1)])
        loop = _loop(tokenizer, engine, [tool], response_length=4096,
                     multi_turn={"max_tool_response_length": 64, "max_parallel_calls": 2})
        out = asyncio.run(loop.generate([_prompt("z")]))
        (traj,) = out
        assert traj.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), traj.error
        traj.check_invariants()
        sampled = [traj.response_ids[s.start:s.end] for s in traj.turns if s.role == "assistant"]
        assert sampled == engine.returned["z/0"]
        first_turn_text = traj.messages[1]["content"]
        calls = [c for c in traj.tool_calls if c.turn == 0]
        if engine.returned["z/0"][0][-1] == tokenizer.eos_token_id:  # the turn was not cut by the token budget
            assert len(calls) >= first_turn_text.count("<tool_call>")
        for c in calls:
            if c.error is None:
                # JSON Schema's "integer" admits integral floats (0.0), so check integrality, not the Python type
                a, b = c.arguments["a"], c.arguments["b"]
                assert c.name == "add" and all(type(v) in (int, float) and float(v).is_integer() for v in (a, b))
                assert c.result == str(c.arguments["a"] + c.arguments["b"])
                seen["ok_calls"] += 1
            else:
                assert c.result.startswith("Error")
                seen["errors"] += 1
        assert sum(m["role"] == "tool" for m in traj.messages) == len(traj.tool_calls)
        seen["examples"] += 1

    run()
    assert seen["examples"] >= 1000
    assert seen["errors"] > 500 and seen["ok_calls"] > 0  # the fuzz reaches both the error and the success paths
    assert tool.created == tool.released


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(text=_outputs, fmt=st.sampled_from(["qwen25", "hermes"]))
def test_fuzz_parser_alone_never_raises(text, fmt):
    """Contract: the parser turns any text into calls or malformed-call records for both default formats, never raising."""
    parser = ToolCallParser([AddTool().tool_schema], fmt)
    turn = parser.parse(text)
    assert len(turn.calls) >= text.count("<tool_call>")
    for c in turn.calls:
        assert c.raw.startswith("<tool_call>")
