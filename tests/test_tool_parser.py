"""Tool-call parsing contract: the whole turn is parsed at once, with SGLang's reading of a call, so a
`<tool_call>` inside a JSON string argument stays in the argument; the layouts verl's hermes parser accepts
parse; malformed calls are data (a kind and a message), never an exception."""

from __future__ import annotations

import json

import pytest
from sglang.srt.entrypoints.openai.protocol import Function, Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser

from rollout.tool_parser import MalformedCall, ParsedCall, ToolCallParser
from rollout.tools.schemas import OpenAIFunctionToolSchema

pytestmark = pytest.mark.unit

PYTHON = {"type": "function", "function": {"name": "python", "description": "run code", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def parser(fmt: str = "qwen25") -> ToolCallParser:
    return ToolCallParser([OpenAIFunctionToolSchema.from_dict(PYTHON)], fmt)


def sglang_calls(text: str) -> list[tuple[str, dict]]:
    fn = PYTHON["function"]
    sgl = FunctionCallParser([Tool(type="function", function=Function(**fn))], "qwen25")
    return [(c.name, json.loads(c.parameters)) for c in sgl.parse_non_stream(text)[1]]


@pytest.mark.parametrize("fmt", ["qwen25", "hermes"])
def test_tool_call_tag_inside_a_json_string_argument_stays_in_the_argument(fmt):
    """Code that prints the tags is one well-formed call, as SGLang's parser reads the whole text."""
    code = 'print("<tool_call>")\nprint("</tool_call>")'
    text = "Let me run it.\n<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + \
        "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": "1"}}) + "\n</tool_call>"
    turn = parser(fmt).parse(text)
    assert turn.text == "Let me run it."
    assert [(c.name, c.arguments) for c in turn.calls] == sglang_calls(text) == [
        ("python", {"code": code}), ("python", {"code": "1"})]


@pytest.mark.parametrize("layout", [
    '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>',  # no newlines
    '<tool_call>\r\n{"name": "python", "arguments": {"code": "1"}}\r\n</tool_call>',  # CRLF
    '<tool_call>\t{"name": "python",\t"arguments": {"code": "1"}}\t</tool_call>',  # tabs
    '<tool_call>  \n {"name": "python", "parameters": {"code": "1"}}\n\n</tool_call>',  # SGLang's "parameters"
], ids=["no-newline", "crlf", "tabs", "spaces-parameters"])
def test_layouts_verl_hermes_accepts_parse(layout):
    (call,) = parser("hermes").parse("ok " + layout).calls
    assert isinstance(call, ParsedCall) and (call.name, call.arguments) == ("python", {"code": "1"})


def test_malformed_calls_are_data_and_do_not_hide_the_next_call():
    """A broken call gives a MalformedCall with its kind; the well-formed call after it still runs."""
    text = ('<tool_call>\n{"name": "python", "arguments": {"code": "1"\n</tool_call>'
            '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
            '<tool_call>\n{"name": "python", "arguments": {"code": [3]}}\n</tool_call>'
            '<tool_call>\n{"name": "python", "arguments": {"code": "2"}}\n</tool_call>'
            '<tool_call>\n{"name": "python", "arguments": {"code": "4"}}')
    calls = parser().parse(text).calls
    assert [c.kind if isinstance(c, MalformedCall) else c.arguments for c in calls] == [
        "bad_json", "unknown_tool", "bad_arguments", {"code": "2"}, "unparsed"]
    assert all(c.message.startswith("Error") for c in calls if isinstance(c, MalformedCall))


def test_an_integer_too_long_for_python_is_malformed_not_a_crash():
    """Contract: `parse` never raises: a 5000-digit integer (past `sys.get_int_max_str_digits`) in a call is bad_json,
    in arguments written as a JSON string bad_arguments, and the call after them still runs."""
    big = f'{{"code": {"1" * 5000}}}'
    text = (f'<tool_call>{{"name": "python", "arguments": {big}}}</tool_call>'
            f'<tool_call>{{"name": "python", "arguments": {json.dumps(big)}}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "2"}}</tool_call>')
    calls = parser().parse(text).calls
    assert [c.kind if isinstance(c, MalformedCall) else c.arguments for c in calls] == [
        "bad_json", "bad_arguments", {"code": "2"}]
