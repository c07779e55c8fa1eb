"""`ToolRunner`: the only way rollout code calls a tool.

Wraps one `BaseTool` and enforces, per tool (from the tool's YAML `config`):

- `max_concurrency` (default 64): calls of this tool in flight at once, across trajectories;
- `rate_limit` (calls per second, default unlimited): calls are spaced at least 1/rate apart;
- `timeout_s` (default 30): a call running longer is *cancelled* (its asyncio task gets
  `CancelledError`, so a subprocess-backed tool kills its process) and reported as a timeout;
- `max_response_chars` (default 8192): longer responses are cut, with a marker the model sees.

Failures are data, never exceptions: a tool that raises, times out, or is called with
arguments that do not fit its schema gives a `ToolCallResult` whose `text` tells the model
what went wrong and whose `error` / `timed_out` flags feed the metrics. `release` is always
called for every created instance (`session()` guarantees it, also on cancellation), and the
runner counts both so tests and metrics can assert `created == released` (the shared
lifecycle is `rollout.plugins.PluginRunner`).

verl's call shapes: `create`, `execute`, `calc_reward` and `release` get the sample's kwargs
in the shape each method's signature asks for (`rollout.plugins.kwargs_shape`, read once here,
at load: flat, under `create_kwargs=` / ..., or both at once for `**kwargs`); `create` returns
an id or `(id, response)`; `execute` returning `(response, step_reward, metrics)` where the
response is a str, a dict with `text` / `image` / `video`, or any `ToolResponse`-like object
(verl's pydantic one included). A response from `create` is kept and put before the
instance's first `execute` response, so the model sees it.

Departs from verl, where a tool exception propagates and kills the rollout batch and a hung
tool hangs it; the agent loop's token-budget truncation comes on top of the char cap here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rollout.plugins import PluginConfigError, PluginRunner, kwargs_shape, shaped_kwargs
from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)

TRUNCATION_MARKER = "\n...[truncated {n} chars]"


@dataclass
class ToolCallResult:
    """The outcome of one tool call, as the agent loop records it."""

    text: str  # what the model sees in the tool message (already truncated)
    step_reward: float = 0.0  # the tool's step reward (0.0 on error / timeout)
    metrics: dict[str, Any] = field(default_factory=dict)  # the tool's own metrics
    error: str | None = None  # why the call failed (bad arguments, exception, timeout), None if it ran
    timed_out: bool = False  # the call was cancelled after `timeout_s`
    truncated: bool = False  # the response was longer than `max_response_chars` and was cut
    latency_s: float = 0.0  # wall time of the call, waiting for limits excluded
    response: ToolResponse | None = None  # the full ToolResponse (multi-modal parts kept)


# Each tool method, the fixed arguments the runner passes it, and the name of its nested kwargs.
TOOL_CALLS = {"create": ((), "create_kwargs"), "execute": (("instance_id", "parameters"), "execute_kwargs"),
              "calc_reward": (("instance_id",), "calc_reward_kwargs"), "release": (("instance_id",), "release_kwargs")}


@dataclass
class ToolLimits:
    """Per-tool limits and argument checking, read from the tool's YAML `config`."""

    max_concurrency: int = 64
    rate_limit: float | None = None  # calls per second; None = unlimited
    timeout_s: float = 30.0
    max_response_chars: int = 8192
    strict_arguments: bool = False  # validate arguments against the full JSON schema as written (no coercion)

    @classmethod
    def from_config(cls, config: dict[str, Any], tool_name: str) -> ToolLimits:
        """Limits from a tool's `config`; PluginConfigError naming the tool and the bad key."""
        limits = cls(
            max_concurrency=int(config.get("max_concurrency", cls.max_concurrency)),
            rate_limit=None if config.get("rate_limit") is None else float(config["rate_limit"]),
            timeout_s=float(config.get("timeout_s", cls.timeout_s)),
            max_response_chars=int(config.get("max_response_chars", cls.max_response_chars)),
            strict_arguments=bool(config.get("strict_arguments", cls.strict_arguments)),
        )
        if limits.max_concurrency < 1:
            raise PluginConfigError(f"tool {tool_name!r}: config.max_concurrency must be >= 1, got {limits.max_concurrency}")
        if limits.rate_limit is not None and limits.rate_limit <= 0:
            raise ValueError(
                f"tool {tool_name!r}: config.rate_limit must be > 0 calls/s (or omitted), got {limits.rate_limit}"
            )
        if limits.timeout_s <= 0:
            raise PluginConfigError(f"tool {tool_name!r}: config.timeout_s must be > 0, got {limits.timeout_s}")
        if limits.max_response_chars < 1:
            raise ValueError(
                f"tool {tool_name!r}: config.max_response_chars must be >= 1, got {limits.max_response_chars}"
            )
        return limits


def to_tool_response(response: Any) -> ToolResponse:
    """A tool's response as polyturn's `ToolResponse`: from a str, a dict (`text`, `image`, `video`),
    or any object with those attributes (verl's pydantic `ToolResponse`)."""
    if isinstance(response, ToolResponse):
        return response
    if isinstance(response, str):
        return ToolResponse(text=response)
    if isinstance(response, dict):
        return ToolResponse(text=response.get("text"), image=response.get("image"), video=response.get("video"))
    if hasattr(response, "text"):
        return ToolResponse(text=response.text, image=getattr(response, "image", None),
                            video=getattr(response, "video", None))
    return ToolResponse(text=str(response))


def provided_schema(tool: Any) -> Any:
    """The schema a tool provides, as it gives it (`get_openai_tool_schema()` or `tool_schema`; None if neither)."""
    getter = getattr(tool, "get_openai_tool_schema", None)
    return getter() if callable(getter) else getattr(tool, "tool_schema", None)


def tool_schema_of(tool: Any) -> OpenAIFunctionToolSchema:
    """The schema a tool shows the model (`provided_schema`), as ours."""
    schema = provided_schema(tool)
    if isinstance(schema, OpenAIFunctionToolSchema):
        return schema
    if hasattr(schema, "model_dump"):  # verl's pydantic schema
        schema = schema.model_dump(exclude_none=True)
    return OpenAIFunctionToolSchema.from_dict(schema, where=f"{type(tool).__name__}.tool_schema")


class ToolRunner(PluginRunner[Any]):
    """Runs one tool under its limits; safe to share across trajectories of one event loop."""

    kind = "tool"

    def __init__(self, tool: Any, limits: ToolLimits | None = None):
        schema = tool_schema_of(tool)
        name = getattr(tool, "name", None) or schema.function.name
        self.limits = limits or ToolLimits.from_config(dict(getattr(tool, "config", None) or {}), name)
        self.schema = schema.with_strict_arguments(self.limits.strict_arguments)  # parsing checks with this
        super().__init__(tool, name)
        # method -> "flat" | "nested" | "both", from the signatures, once
        self.shapes = {m: kwargs_shape(getattr(tool, m), fixed, nested, f"tool {name!r}: {type(tool).__name__}.{m}")
                       for m, (fixed, nested) in TOOL_CALLS.items()}
        self._semaphore: asyncio.Semaphore | None = None
        self._rate_lock: asyncio.Lock | None = None
        self._next_slot = 0.0
        self._opening: dict[str, ToolResponse] = {}  # create's response, shown with the first result

    @property
    def tool(self) -> Any:
        return self.plugin

    @property
    def timeout_s(self) -> float:  # type: ignore[override]
        return self.limits.timeout_s

    def _limiters(self) -> tuple[asyncio.Semaphore, asyncio.Lock]:
        # Created lazily so a runner built outside an event loop binds to the loop that uses it.
        if self._semaphore is None or self._rate_lock is None:
            self._semaphore = asyncio.Semaphore(self.limits.max_concurrency)
            self._rate_lock = asyncio.Lock()
        return self._semaphore, self._rate_lock

    async def _wait_rate_slot(self, lock: asyncio.Lock) -> None:
        if self.limits.rate_limit is None:
            return
        async with lock:
            now = time.monotonic()
            wait = self._next_slot - now
            self._next_slot = max(now, self._next_slot) + 1.0 / self.limits.rate_limit
        if wait > 0:
            await asyncio.sleep(wait)

    def _kwargs(self, method: str, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        return shaped_kwargs(self.shapes[method], TOOL_CALLS[method][1], dict(kwargs or {}))

    async def create(self, create_kwargs: dict[str, Any] | None = None) -> str:
        """Create an instance with the sample's `create_kwargs`, in the shape `create` takes."""
        box: dict[str, Any] = {}

        async def opened() -> str:
            out = await self.tool.create(**self._kwargs("create", create_kwargs))
            iid, response = out if isinstance(out, tuple) else (out, None)
            box["response"] = response
            return iid

        iid = await self._open(opened())
        if box.get("response") is not None:
            self._opening[iid] = to_tool_response(box["response"])
        return iid

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        """Release an instance; errors and timeouts are logged, never raised."""
        self._opening.pop(instance_id, None)
        await self.close(instance_id, "release", **self._kwargs("release", release_kwargs))

    def session(self, create_kwargs: dict[str, Any] | None = None,
                release_kwargs: dict[str, Any] | None = None):
        """`async with runner.session(create_kwargs, release_kwargs) as iid:` — release guaranteed."""
        return self._session(lambda: self.create(create_kwargs), "release", self._kwargs("release", release_kwargs))

    async def execute(self, instance_id: str, parameters: Any, **execute_kwargs: Any) -> ToolCallResult:
        """Run one call under the limits; never raises (except for cancellation of the caller)."""
        parameters, problems = self.schema.check_arguments(parameters)
        if problems:
            msg = f"Error: invalid arguments for tool '{self.name}': " + "; ".join(problems)
            return ToolCallResult(text=msg, error="invalid_arguments: " + "; ".join(problems))
        semaphore, rate_lock = self._limiters()
        async with semaphore:
            await self._wait_rate_slot(rate_lock)
            start = time.monotonic()
            try:
                raw = await self._timed(self.tool.execute(instance_id, parameters,
                                                          **self._kwargs("execute", execute_kwargs)))
            except TimeoutError:
                logger.warning("tool %r timed out after %.1fs (instance %s)", self.name, self.timeout_s, instance_id)
                return ToolCallResult(
                    text=f"Error: tool '{self.name}' timed out after {self.timeout_s:g}s and was stopped.",
                    error="timeout", timed_out=True, latency_s=time.monotonic() - start,
                )
            except Exception as exc:  # noqa: BLE001 - tool failures are data for the model
                logger.warning("tool %r raised %s: %s", self.name, type(exc).__name__, exc)
                return ToolCallResult(
                    text=f"Error: tool '{self.name}' failed: {type(exc).__name__}: {exc}",
                    error=f"{type(exc).__name__}: {exc}", latency_s=time.monotonic() - start,
                )
            latency = time.monotonic() - start
        return self._to_result(raw, latency, self._opening.pop(instance_id, None))

    def _to_result(self, raw: Any, latency: float, opening: ToolResponse | None) -> ToolCallResult:
        if not (isinstance(raw, tuple) and len(raw) == 3):
            msg = f"tool '{self.name}' returned {type(raw).__name__}; execute() must return (response, step_reward, metrics)"
            return ToolCallResult(text=f"Error: {msg}", error=msg, latency_s=latency)
        response, step_reward, metrics = raw
        response = to_tool_response(response)
        if opening is not None and opening.text:
            response = ToolResponse(text=opening.text + "\n" + (response.text or ""), image=response.image,
                                    video=response.video)
        text = response.text or ""
        truncated = len(text) > self.limits.max_response_chars
        if truncated:
            dropped = len(text) - self.limits.max_response_chars
            text = text[: self.limits.max_response_chars] + TRUNCATION_MARKER.format(n=dropped)
            response = ToolResponse(text=text, image=response.image, video=response.video)
        try:
            reward = float(step_reward)
        except (TypeError, ValueError):
            logger.warning("tool %r returned a non-numeric step reward %r; using 0.0", self.name, step_reward)
            reward = 0.0
        return ToolCallResult(text=text, step_reward=reward, metrics=dict(metrics or {}), truncated=truncated,
                              latency_s=latency, response=response)

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The instance's reward; a failing, hung or non-numeric `calc_reward` gives 0.0 and a logged error."""
        return await self.score("calc_reward", instance_id, **self._kwargs("calc_reward", calc_reward_kwargs))
