"""Tool-call parsing of one assistant turn with SGLang's own `FunctionCallParser`.

The model's text is split at each call trigger of the configured format (`<tool_call>` for
`qwen25` / `hermes`) and every block is parsed by SGLang's detector for that format, so the
format rules are SGLang's, not a second copy of them. Each block becomes either a call ready
to run or a `MalformedCall` with a kind and a message that is fed back to the model as a
tool-role message (and counted as a metric); nothing the model writes raises.

Where it departs from calling `FunctionCallParser.parse_non_stream` on the whole text: that
call silently drops blocks with bad JSON and calls to unknown tools (it only logs a
warning), which is how "tools silently never called" happens in RL. Parsing block by block
lets us say which block failed and why: `bad_json`, `unknown_tool`, `bad_arguments` (do not
fit the tool's JSON schema) or `unparsed` (the block is not in the format's shape, e.g. a
missing closing tag).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from sglang.srt.entrypoints.openai.protocol import Function, Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser

from rollout.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionToolSchema

logger = logging.getLogger(__name__)

# Every tool-call format name SGLang's FunctionCallParser knows (the `multi_turn.format` choices).
SUPPORTED_FORMATS = tuple(sorted(FunctionCallParser.ToolCallParserEnum))


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

    def __init__(self, schemas: list[OpenAIFunctionToolSchema], fmt: str = "qwen25"):
        if fmt not in FunctionCallParser.ToolCallParserEnum:
            raise ValueError(f"tool-call format {fmt!r} is not known to SGLang's FunctionCallParser; use one of {SUPPORTED_FORMATS}")
        self.format = fmt
        self.schemas = {s.function.name: s for s in schemas}
        tools = [
            Tool(type="function", function=Function(name=s.function.name, description=s.function.description,
                                                    parameters=s.function.parameters))
            for s in schemas
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
        if not self._trigger:
            return ParsedTurn(text=text, calls=self._parse_block(text, whole=True))
        first = text.find(self._trigger)
        if first == -1:
            return ParsedTurn(text=text, calls=[])
        calls: list[ParsedCall | MalformedCall] = []
        starts = []
        pos = first
        while pos != -1:
            starts.append(pos)
            pos = text.find(self._trigger, pos + len(self._trigger))
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(text)
            calls.extend(self._parse_block(text[start:end], whole=False))
        return ParsedTurn(text=text[:first].strip(), calls=calls)

    # ---- one block ---------------------------------------------------------------------

    def _parse_block(self, block: str, whole: bool) -> list[ParsedCall | MalformedCall]:
        try:
            _, items = self._parser.parse_non_stream(block)
        except Exception as exc:  # SGLang's detectors raise on some non-object JSON (e.g. a bare list of ints)
            logger.debug("SGLang parser raised on a tool-call block: %r", exc)
            items = []
        if not items:
            return [] if whole else [self._diagnose(block)]
        out: list[ParsedCall | MalformedCall] = []
        for item in items:
            out.append(self._check(item.name, item.parameters, block))
        return out

    def _check(self, name: str | None, parameters: str, block: str) -> ParsedCall | MalformedCall:
        if not name or name not in self.schemas:
            return self._unknown(name, block)
        call, decode_error = OpenAIFunctionCallSchema.from_raw(name, parameters)
        if decode_error is not None:
            return MalformedCall("bad_arguments", name, f"Error: call to `{name}`: {decode_error}.", block)
        errors = self.schemas[name].validate_arguments(call.arguments)
        if errors:
            return MalformedCall(
                "bad_arguments", name,
                f"Error: arguments of `{name}` do not fit its schema: {'; '.join(errors)}. "
                f"Parameters: {json.dumps(self.schemas[name].function.parameters)}",
                block,
            )
        return ParsedCall(name=name, arguments=call.arguments, raw=block)

    def _unknown(self, name: Any, block: str) -> MalformedCall:
        known = ", ".join(sorted(self.schemas))
        return MalformedCall(
            "unknown_tool", name if isinstance(name, str) else None,
            f"Error: there is no tool named {name!r}; available tools: {known}.", block,
        )

    def _diagnose(self, block: str) -> MalformedCall:
        """Say why SGLang's detector produced no call for a block that starts with the trigger."""
        body = block[len(self._trigger):]
        end = body.find(self._end) if self._end else -1
        if end == -1:
            return MalformedCall(
                "unparsed", None,
                f"Error: tool call is not closed with {self._end!r}. Write a call as {self._example}.", block,
            )
        body = body[:end].strip()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nesting too deep"
            return MalformedCall(
                "bad_json", None, f"Error: tool call is not valid JSON ({msg}). Write a call as {self._example}.", block
            )
        objs = obj if isinstance(obj, list) else [obj]
        for o in objs:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                return MalformedCall(
                    "bad_json", None,
                    f"Error: a tool call must be a JSON object with a string \"name\" and an \"arguments\" object. "
                    f"Write a call as {self._example}.", block,
                )
            if o["name"] not in self.schemas:
                return self._unknown(o["name"], block)
        # Valid JSON naming known tools, yet the detector took nothing: the layout is off (e.g. missing newlines).
        return MalformedCall(
            "unparsed", objs[0]["name"] if objs else None,
            f"Error: tool call is not in the expected layout. Write a call exactly as {self._example}.", block,
        )
