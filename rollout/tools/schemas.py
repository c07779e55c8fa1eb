"""Tool schemas (OpenAI function format) and tool responses, as plain dataclasses.

A tool describes itself to the model with an OpenAI function schema: a name, a description
and a JSON-schema object for its arguments. The same schema is rendered into the chat
template (`to_openai()`) and used to check the arguments of every parsed call
(`validate_arguments`), so a call that does not fit is turned into an error message for the
model instead of reaching the tool.

Departs from verl's pydantic models: these are dataclasses built by `from_dict`, which checks
the schema itself (with `jsonschema`'s meta-schema) when the YAML is loaded, so a bad schema
fails at start-up naming the field, not mid-rollout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema

_PARAMETER_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


class ToolSchemaError(ValueError):
    """A tool schema is malformed (raised when a tool config is loaded)."""


@dataclass
class OpenAIFunctionSchema:
    """The `function` part of an OpenAI tool schema."""

    name: str  # what the model writes in a call's "name"
    description: str  # shown to the model in the chat template
    parameters: dict[str, Any]  # JSON schema of the arguments; top-level type "object"
    strict: bool = False  # OpenAI's strict flag; kept for round trips, not used here


@dataclass
class OpenAIFunctionToolSchema:
    """An OpenAI tool schema: `{"type": "function", "function": {...}}`."""

    function: OpenAIFunctionSchema
    type: str = "function"
    _validator: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: Any, where: str = "tool_schema") -> OpenAIFunctionToolSchema:
        """Build and check a schema from its dict form; `where` names it in errors."""
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
        schema = OpenAIFunctionSchema(
            name=name, description=description, parameters=parameters, strict=bool(fn.get("strict", False))
        )
        return cls(function=schema)

    def to_openai(self) -> dict[str, Any]:
        """The dict the chat template and OpenAI-style APIs expect."""
        fn: dict[str, Any] = {
            "name": self.function.name,
            "description": self.function.description,
            "parameters": self.function.parameters,
        }
        if self.function.strict:
            fn["strict"] = True
        return {"type": self.type, "function": fn}

    def validate_arguments(self, arguments: Any) -> list[str]:
        """Errors of a call's arguments against the schema (empty list when they fit).

        Each error names the argument path, e.g. `expression: 3 is not of type 'string'`.
        """
        if self._validator is None:
            self._validator = jsonschema.Draft202012Validator(self.function.parameters)
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        out = []
        for err in errors:
            path = ".".join(str(p) for p in err.absolute_path) or "arguments"
            out.append(f"{path}: {err.message}")
        return out


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
        typ = sub.get("type") if isinstance(sub, dict) else None
        types = typ if isinstance(typ, list) else [typ]
        if typ is not None and not set(types) <= _PARAMETER_TYPES:
            raise ToolSchemaError(
                f"{where}.properties.{prop}.type: unknown type {typ!r}; use one of {sorted(_PARAMETER_TYPES)}"
            )
    for req in parameters.get("required", []):
        if req not in properties:
            raise ToolSchemaError(f"{where}.required: {req!r} is required but not listed in properties; add it there")


@dataclass
class OpenAIFunctionCallSchema:
    """A parsed tool call: the tool's name and its decoded arguments."""

    name: str
    arguments: dict[str, Any]

    @classmethod
    def from_raw(cls, name: str, arguments: str | dict[str, Any]) -> tuple[OpenAIFunctionCallSchema, str | None]:
        """Decode a call whose arguments may still be a JSON string.

        Returns the call and a decode error (None when the arguments decoded to an object);
        on error the arguments are `{}` so the caller can still report which tool was meant.
        """
        if isinstance(arguments, dict):
            return cls(name=name, arguments=arguments), None
        try:
            decoded = json.loads(arguments)
        except (json.JSONDecodeError, TypeError) as exc:
            return cls(name=name, arguments={}), f"arguments are not valid JSON: {exc}"
        if not isinstance(decoded, dict):
            return cls(name=name, arguments={}), f"arguments must be a JSON object, got {type(decoded).__name__}"
        return cls(name=name, arguments=decoded), None


@dataclass
class ToolResponse:
    """What a tool returns to the model (verl 0.5+ shape). Only `text` is rendered by the text rollout."""

    text: str | None = None
    image: list[Any] | None = None  # multi-modal payloads, passed through untouched
    video: list[Any] | None = None
