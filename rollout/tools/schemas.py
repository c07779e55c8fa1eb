"""Tool schemas and tool responses, as verl's pydantic models (`verl.tools.schemas`, same names
and fields), so code written against verl (`tool_schema.model_dump()`, `ToolResponse(text=...)`,
`OpenAIFunctionToolSchema.model_validate({...})`) runs unchanged.

A tool describes itself to the model with an OpenAI function schema: a name, a description
and a JSON-schema object for its arguments. The same schema is rendered into the chat
template (`to_openai()`) and checks the arguments of every parsed call (`check_arguments`),
so a call that does not fit becomes an error message for the model instead of reaching the tool.

Departs from verl:
- `from_dict` checks the schema itself (with `jsonschema`'s meta-schema) when the YAML is
  loaded, so a bad schema fails at start-up naming the field, not mid-rollout; parameter and
  property schemas keep every JSON-schema key (`items`, `minimum`, nested objects ...), where
  verl's models keep only `type`, `description`, `enum`.
- Arguments are taken as verl's tools take them (verl checks none; its tools call `str()` on
  what they read): a number given for a string field becomes its text, an integral string
  given for an integer field becomes the integer, at any depth (nested properties, array items).
  The result is then validated against the whole JSON schema (item types, bounds, enums,
  required keys of nested objects ...), so a bool, null or container given for a scalar, a
  value out of bounds or a missing required argument is refused. A tool opts in to validation
  of the arguments as written, with no text/number coercion, with `config.strict_arguments: true`.
  In both modes an integral number for an integer field (`3.0`, an integer in JSON schema)
  reaches the tool as an int, and NaN or an infinity (which Python's `json` reads) is no number. OpenAPI's
  `nullable: true` (function tools' `Optional[X]` parameters) lets null through.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

_PARAMETER_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_INTEGRAL = re.compile(r"[+-]?\d+")
MAX_ARGUMENT_DEPTH = 64  # arguments nested deeper are refused unchecked (validators recurse per level)


def _json_number(_checker: Any, value: Any) -> bool:
    """JSON schema's number, less NaN and infinities (Python's `json` reads `NaN`, `Infinity`; JSON has neither)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _type_or_nullable(validator: Any, types: Any, instance: Any, schema: dict[str, Any]) -> Any:
    """JSON schema's `type`, with OpenAPI's `nullable: true` (what transformers' schemas give `Optional[X]`) letting
    null through."""
    if instance is None and schema.get("nullable") is True:
        return
    yield from jsonschema.Draft202012Validator.VALIDATORS["type"](validator, types, instance, schema)


_ArgumentValidator = jsonschema.validators.extend(  # draft 2020-12, numbers as JSON has them, `nullable` honoured
    jsonschema.Draft202012Validator, validators={"type": _type_or_nullable},
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("number", _json_number))


class ToolSchemaError(ValueError):
    """A tool schema is malformed (raised when a tool config is loaded)."""


class OpenAIFunctionPropertySchema(BaseModel):
    """One argument's JSON schema (verl's fields; any other JSON-schema key is kept as is)."""

    model_config = ConfigDict(extra="allow")

    type: str | list[str] | None = None  # JSON-schema type(s); verl: str
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """The arguments' JSON schema: an object (verl's fields; other JSON-schema keys kept)."""

    model_config = ConfigDict(extra="allow")

    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    """The `function` part of an OpenAI tool schema."""

    name: str  # what the model writes in a call's "name"
    description: str = ""  # shown to the model in the chat template
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False  # OpenAI's strict flag; rendered when set (argument checking: config.strict_arguments)
    _as_written: dict[str, Any] | None = PrivateAttr(default=None)  # `parameters` as the config wrote them

    def parameters_json(self) -> dict[str, Any]:
        """The arguments' JSON schema as a plain dict, as written (keys in their order, unset defaults left out),
        so the chat template renders what the config says."""
        if self._as_written is not None:
            return self._as_written
        out = self.parameters.model_dump(exclude_unset=True)
        out.setdefault("type", "object")
        return out


class OpenAIFunctionToolSchema(BaseModel):
    """An OpenAI tool schema: `{"type": "function", "function": {...}}`."""

    type: str = "function"
    function: OpenAIFunctionSchema
    _strict_arguments: bool = PrivateAttr(default=False)  # validate arguments as written, no coercion (opt-in)
    _validator: Any = PrivateAttr(default=None)

    @classmethod
    def from_dict(cls, data: Any, where: str = "tool_schema") -> OpenAIFunctionToolSchema:
        """Build and check a schema from its dict form (or a verl / pydantic schema); `where` names it in errors."""
        if hasattr(data, "model_dump") and not isinstance(data, cls):
            data = data.model_dump(exclude_unset=True)
        if isinstance(data, cls):
            _check_parameters(data.function.parameters_json(), f"{where}.function.parameters")
            return data
        if not isinstance(data, dict):
            raise ToolSchemaError(f"{where}: expected a mapping with 'type' and 'function', got {type(data).__name__}")
        if data.get("type", "function") != "function":
            raise ToolSchemaError(f"{where}.type: only 'function' tools are supported, got {data.get('type')!r}")
        fn = data.get("function")
        if not isinstance(fn, dict):
            raise ToolSchemaError(f"{where}.function: missing; add `function: {{name, description, parameters}}`")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ToolSchemaError(f"{where}.function.name: must be a non-empty string, got {name!r}")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise ToolSchemaError(f"{where}.function.description: must be a string, got {type(description).__name__}")
        parameters = fn.get("parameters", {"type": "object", "properties": {}, "required": []})
        _check_parameters(parameters, f"{where}.function.parameters")
        function = OpenAIFunctionSchema(name=name, description=description, parameters=parameters,
                                        strict=bool(fn.get("strict", False)))
        function._as_written = parameters
        return cls(type="function", function=function)

    def with_strict_arguments(self, strict: bool) -> OpenAIFunctionToolSchema:
        """A copy whose `check_arguments` validates the arguments as written (no text/number coercion)."""
        copy = self.model_copy()
        copy._strict_arguments = bool(strict)
        copy._validator = None
        return copy

    @property
    def strict_arguments(self) -> bool:
        """Whether arguments are validated as written (`config.strict_arguments`), without verl's coercions."""
        return self._strict_arguments

    def to_openai(self) -> dict[str, Any]:
        """The dict the chat template and OpenAI-style APIs expect."""
        fn: dict[str, Any] = {"name": self.function.name, "description": self.function.description,
                              "parameters": self.function.parameters_json()}
        if self.function.strict:
            fn["strict"] = True
        return {"type": self.type, "function": fn}

    def check_arguments(self, arguments: Any) -> tuple[dict[str, Any], list[str]]:
        """(the arguments as the tool gets them, errors); no errors means the call may run.

        The arguments are coerced (`_take`), then validated against the whole JSON schema. Each error names
        the argument by its path, e.g. `tags.0: None is not of type 'string'`. Never raises: arguments nested
        deeper than MAX_ARGUMENT_DEPTH are refused without being walked.
        """
        if not isinstance(arguments, dict):
            return {}, [f"arguments: must be a JSON object, got {type(arguments).__name__}"]
        if nesting_depth(arguments) > MAX_ARGUMENT_DEPTH:
            return arguments, [f"arguments: nested deeper than {MAX_ARGUMENT_DEPTH} levels"]
        if self._validator is None:
            self._validator = _ArgumentValidator(self.function.parameters_json())
        taken = _take(arguments, self._validator.schema, lenient=not self._strict_arguments)
        try:
            errors = sorted(self._validator.iter_errors(taken), key=lambda e: list(e.absolute_path))
        except RecursionError:
            return taken, ["arguments: nested too deeply to validate"]
        return taken, [f"{'.'.join(str(p) for p in e.absolute_path) or 'arguments'}: {e.message}" for e in errors]


def nesting_depth(value: Any, limit: int = MAX_ARGUMENT_DEPTH + 1) -> int:
    """Levels of nested lists / dicts (a scalar: 0, `{}`: 1), counted without recursion, up to `limit`."""
    depth, level = 0, [value]
    while depth < limit:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            break
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def _take(value: Any, schema: Any, lenient: bool) -> Any:
    """`value` as the tool gets it under `schema`: scalars through `_coerce`, dicts and lists walked along
    `properties` / `additionalProperties` / `items` (recursion bounded by the arguments' checked depth)."""
    if not isinstance(schema, dict):  # a boolean schema, or none applies: as written
        return value
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = None if "patternProperties" in schema else schema.get("additionalProperties")
        return {k: _take(v, properties.get(k, extra), lenient) for k, v in value.items()}
    if isinstance(value, list):
        return [_take(v, schema.get("items"), lenient) for v in value]
    types = schema.get("type") or []
    return _coerce(value, types if isinstance(types, list) else [types], lenient)


def _coerce(value: Any, types: list[str], lenient: bool) -> Any:
    """An integral number for an integer field as an int; when `lenient`, also verl's tools' reading of an
    argument: numbers as text for strings, integral text as integers."""
    if isinstance(value, bool) or value is None:
        return value
    if "integer" in types and isinstance(value, float) and value.is_integer():
        return int(value)
    if not lenient:
        return value
    if "string" in types and isinstance(value, (int, float)) and not {"integer", "number"} & set(types):
        return str(value)
    if "integer" in types and isinstance(value, str) and "string" not in types and _INTEGRAL.fullmatch(value.strip()):
        try:
            return int(value)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits): refused as text
            return value
    return value


def _check_parameters(parameters: Any, where: str) -> None:
    if not isinstance(parameters, dict):
        raise ToolSchemaError(f"{where}: must be a JSON-schema mapping, got {type(parameters).__name__}")
    if parameters.get("type") != "object":
        raise ToolSchemaError(
            f"{where}.type: must be 'object' (arguments are a JSON object), got {parameters.get('type')!r}"
        )
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as exc:
        path = ".".join(str(p) for p in exc.absolute_path)
        raise ToolSchemaError(f"{where}{'.' + path if path else ''}: invalid JSON schema: {exc.message}") from None
    properties = parameters.get("properties", {})
    for prop, sub in properties.items():
        if not isinstance(sub, dict):
            raise ToolSchemaError(f"{where}.properties.{prop}: must be a JSON-schema mapping, got {sub!r}")
        typ = sub.get("type")
        types = typ if isinstance(typ, list) else [typ]
        if typ is not None and not set(types) <= _PARAMETER_TYPES:
            raise ToolSchemaError(
                f"{where}.properties.{prop}.type: unknown type {typ!r}; use one of {sorted(_PARAMETER_TYPES)}"
            )
    for req in parameters.get("required", []):
        if req not in properties:
            raise ToolSchemaError(f"{where}.required: {req!r} is required but not listed in properties; add it there")


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as parsed from text: its name and its arguments as a JSON string (verl's)."""

    name: str
    arguments: str  # JSON string


class OpenAIFunctionCallSchema(BaseModel):
    """A parsed tool call: the tool's name and its decoded arguments."""

    name: str
    arguments: dict[str, Any]

    @classmethod
    def from_raw(cls, name: str, arguments: Any) -> tuple[OpenAIFunctionCallSchema, str | None]:
        """Decode a call whose arguments may still be a JSON string (OpenAI's wire format).

        Returns the call and a decode error (None when the arguments decoded to an object);
        on error the arguments are `{}` so the caller can still report which tool was meant.
        """
        if isinstance(arguments, dict):
            return cls(name=name, arguments=arguments), None
        try:
            decoded = json.loads(arguments)
        except (ValueError, TypeError, RecursionError) as exc:  # ValueError: JSONDecodeError, or an over-long integer
            return cls(name=name, arguments={}), f"arguments are not valid JSON: {exc}"
        if not isinstance(decoded, dict):
            return cls(name=name, arguments={}), f"arguments must be a JSON object, got {type(decoded).__name__}"
        return cls(name=name, arguments=decoded), None

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """verl's decoder: (call, has_decode_error)."""
        call, error = OpenAIFunctionCallSchema.from_raw(parsed_schema.name, parsed_schema.arguments)
        return call, error is not None


class OpenAIFunctionToolCall(BaseModel):
    """A tool call in OpenAI format (verl's)."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns to the model (verl 0.5+). Only `text` is rendered by the text rollout."""

    text: str | None = None
    image: list[Any] | None = None  # multi-modal payloads, passed through untouched
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values: Any) -> Any:
        for key in ("image", "video"):
            if isinstance(values, dict) and values.get(key) is not None and not isinstance(values[key], list):
                raise ValueError(f"ToolResponse.{key} must be a list, got {type(values[key]).__name__}; "
                                 f"wrap a single {key} in a list: {{'{key}': [x]}}")
        return values

    def is_empty(self) -> bool:
        """No text, image or video."""
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        """Text and no media."""
        return bool(self.text) and not self.image and not self.video
