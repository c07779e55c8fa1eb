"""Tool-call parsing of one assistant turn, on the whole text, with SGLang's format rules.

For the tag formats (`qwen25`, `hermes`: `<tool_call>` ... `</tool_call>`) the whole turn is
scanned once: at each opening tag outside a call, the JSON value that follows is decoded
(so a `<tool_call>` or `</tool_call>` inside a JSON string argument, e.g. code that prints the
tag, belongs to the argument), then the closing tag is expected. Whitespace around the JSON is
free, as in verl's hermes parser: no newline after the tag, CRLF, tabs. A call object is read
as SGLang's detectors read it (`name`, `arguments` or `parameters`; a JSON list holds several
calls). Formats without a literal start tag go to SGLang's `FunctionCallParser` on the whole
text. SGLang is imported when a parser is built (the loop's first sample with tools), never at
this module's import, so importing the loop or the trainer loads no SGLang.

Every call attempt becomes either a call ready to run or a `MalformedCall` with a kind and a
message that is fed back to the model as a tool-role message (and counted as a metric);
nothing the model writes raises. Where it departs from `FunctionCallParser.parse_non_stream`:
that call silently drops blocks with bad JSON and calls to unknown tools (it only logs a
warning), which is how "tools silently never called" happens in RL. Here each failure says
why: `bad_json`, `unknown_tool`, `bad_arguments` (do not fit the tool's schema, checked as verl's
tools read arguments, or strictly when the tool opts in: `OpenAIFunctionToolSchema.check_arguments`;
nesting deeper than `MAX_ARGUMENT_DEPTH` is refused unchecked) or `unparsed` (the block is not
closed, or not in the format's shape). `arguments` written as a JSON string that decodes to an
object (OpenAI's wire format) are decoded.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from rollout.config import TOOL_CALL_FORMATS
from rollout.tools.schemas import (
    MAX_ARGUMENT_DEPTH,
    OpenAIFunctionCallSchema,
    OpenAIFunctionToolSchema,
)

logger = logging.getLogger(__name__)

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')  # a call's tool name, read without decoding the call


@dataclass
class ParsedCall:
    """A well-formed call to a known tool whose arguments fit its schema."""

    name: str  # tool name (a key of the parser's tools)
    arguments: dict[str, Any]  # decoded, schema-checked arguments
    raw: str  # the block of model text it came from


@dataclass
class MalformedCall:
    """A block that looked like a tool call but cannot be run."""

    kind: str  # "bad_json" | "unknown_tool" | "bad_arguments" | "unparsed"
    name: str | None  # the tool name, when one could be read
    message: str  # error text for the model: what is wrong and how a valid call looks
    raw: str  # the block of model text


@dataclass
class ParsedTurn:
    """Result of parsing one assistant turn."""

    text: str  # the normal text before the first call
    calls: list[ParsedCall | MalformedCall]  # in the order the model wrote them

    @property
    def has_calls(self) -> bool:
        """Whether the turn tried to call any tool (well-formed or not)."""
        return bool(self.calls)


class ToolCallParser:
    """Parses assistant text into tool calls for one set of tools (one sample's tools)."""

    def __init__(self, schemas: list[Any], fmt: str = "qwen25"):
        """`schemas`: the tools' schemas (polyturn's, verl's pydantic ones, or dicts). SGLang is imported here, not
        at module import: importing the loop (and the trainer) must not import SGLang before a process's CPU adapter
        runs."""
        from sglang.srt.entrypoints.openai.protocol import Function, Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        if fmt not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool-call format {fmt!r} is not known to SGLang's FunctionCallParser; use one of {TOOL_CALL_FORMATS}")
        self.format = fmt
        ours = [OpenAIFunctionToolSchema.from_dict(s) for s in schemas]
        self.schemas = {s.function.name: s for s in ours}
        tools = [
            Tool(type="function", function=Function(name=s.function.name, description=s.function.description,
                                                    parameters=s.function.parameters_json()))
            for s in ours
        ]
        self._parser = FunctionCallParser(tools=tools, tool_call_parser=fmt)
        bot = getattr(self._parser.detector, "bot_token", "") or ""
        eot = getattr(self._parser.detector, "eot_token", "") or ""
        self._trigger = bot.strip()  # e.g. "<tool_call>"; "" when the format has no literal start tag
        self._end = eot.strip()  # e.g. "</tool_call>"
        self._example = (
            f'{bot}{{"name": "<tool name>", "arguments": {{...}}}}{eot}' if self._trigger else "the model's tool-call format"
        )

    def parse(self, text: str) -> ParsedTurn:
        """Parse one assistant turn's text. Never raises on model output."""
        if not self.schemas:
            return ParsedTurn(text=text, calls=[])
        if self._trigger != "<tool_call>":
            return ParsedTurn(text=text, calls=self._parse_whole(text))
        first = text.find(self._trigger)
        if first == -1:
            return ParsedTurn(text=text, calls=[])
        calls: list[ParsedCall | MalformedCall] = []
        pos = first
        while pos != -1:
            items, end = self._scan_call(text, pos)
            calls.extend(items)
            pos = text.find(self._trigger, end)
        return ParsedTurn(text=text[:first].strip(), calls=calls)

    def _scan_call(self, text: str, start: int) -> tuple[list[ParsedCall | MalformedCall], int]:
        """The call opened at `start`: (its calls, or why it is malformed; where scanning goes on)."""
        body = start + len(self._trigger)
        value_at = len(text) - len(text[body:].lstrip())
        too_deep = False
        try:
            obj, value_end = _DECODER.raw_decode(text, value_at)
        except ValueError:  # JSONDecodeError, or an integer of more digits than Python converts
            obj, value_end = None, -1
        except RecursionError:  # nested past the decoder's recursion: the arguments, as far as a model writes
            obj, value_end, too_deep = None, -1, True
        if value_end != -1:
            close_at = len(text) - len(text[value_end:].lstrip())
            if text.startswith(self._end, close_at):
                end = close_at + len(self._end)
                return self._calls_of(obj, text[start:end]), end
        # Not a JSON value followed by the closing tag: the block runs to the next tag of either kind.
        nxt = [i for i in (text.find(self._end, body), text.find(self._trigger, body)) if i != -1]
        end = min(nxt) if nxt else len(text)
        if text.startswith(self._end, end):
            end += len(self._end)
        name = _NAME.search(text, start, end)
        if too_deep and name and name.group(1) in self.schemas:
            return [MalformedCall("bad_arguments", name.group(1), f"Error: arguments of `{name.group(1)}` are "
                                  f"nested deeper than {MAX_ARGUMENT_DEPTH} levels.", text[start:end])], end
        return [self._diagnose(text[start:end])], end

    def _calls_of(self, obj: Any, block: str) -> list[ParsedCall | MalformedCall]:
        """The calls of one decoded block (an object, or a list of objects as SGLang accepts)."""
        objs = obj if isinstance(obj, list) else [obj]
        if not objs or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs):
            return [MalformedCall(
                "bad_json", None,
                f"Error: a tool call must be a JSON object with a string \"name\" and an \"arguments\" object. "
                f"Write a call as {self._example}.", block)]
        return [self._check(o["name"], o.get("parameters") or o.get("arguments", {}), block) for o in objs]

    # ---- checks ------------------------------------------------------------------------

    def _parse_whole(self, text: str) -> list[ParsedCall | MalformedCall]:
        """Formats without a literal start tag: SGLang's parser on the whole text."""
        try:
            _, items = self._parser.parse_non_stream(text)
        except Exception as exc:  # SGLang's detectors raise on some non-object JSON (e.g. a bare list of ints)
            logger.debug("SGLang parser raised on a turn: %r", exc)
            items = []
        return [self._check(item.name, item.parameters, text) for item in items]

    def _check(self, name: str | None, parameters: Any, block: str) -> ParsedCall | MalformedCall:
        if not name or name not in self.schemas:
            return self._unknown(name, block)
        call, decode_error = OpenAIFunctionCallSchema.from_raw(name, parameters)
        if decode_error is not None:
            return MalformedCall("bad_arguments", name, f"Error: call to `{name}`: {decode_error}.", block)
        arguments, errors = self.schemas[name].check_arguments(call.arguments)
        if errors:
            return MalformedCall(
                "bad_arguments", name,
                f"Error: arguments of `{name}` do not fit its schema: {'; '.join(errors)}. "
                f"Parameters: {json.dumps(self.schemas[name].function.parameters_json())}",
                block,
            )
        return ParsedCall(name=name, arguments=arguments, raw=block)

    def _unknown(self, name: Any, block: str) -> MalformedCall:
        known = ", ".join(sorted(self.schemas))
        return MalformedCall(
            "unknown_tool", name if isinstance(name, str) else None,
            f"Error: there is no tool named {name!r}; available tools: {known}.", block,
        )

    def _diagnose(self, block: str) -> MalformedCall:
        """Why a block opened by the tag holds no call: not closed, or not one JSON value before the close."""
        body = block[len(self._trigger):]
        end = body.find(self._end)
        if end == -1:
            return MalformedCall(
                "unparsed", None,
                f"Error: tool call is not closed with {self._end!r}. Write a call as {self._example}.", block,
            )
        try:
            json.loads(body[:end])
            msg = "text after the JSON value"
        except json.JSONDecodeError as exc:
            msg = exc.msg
        except RecursionError:
            msg = "nesting too deep"
        except ValueError as exc:  # an integer of more digits than Python converts
            msg = str(exc)
        return MalformedCall(
            "bad_json", None, f"Error: tool call is not valid JSON ({msg}). Write a call as {self._example}.", block
        )
