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
runner counts both so tests and metrics can assert `created == released`.

Departs from verl, where a tool exception propagates and kills the rollout batch and a hung
tool hangs it; the agent loop's token-budget truncation comes on top of the char cap here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from rollout.tools.base import BaseTool
from rollout.tools.schemas import ToolResponse

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


@dataclass
class ToolLimits:
    """Per-tool limits, read from the tool's YAML `config`."""

    max_concurrency: int = 64
    rate_limit: float | None = None  # calls per second; None = unlimited
    timeout_s: float = 30.0
    max_response_chars: int = 8192

    @classmethod
    def from_config(cls, config: dict[str, Any], tool_name: str) -> ToolLimits:
        """Limits from a tool's `config`; ValueError naming the tool and the bad key."""
        limits = cls(
            max_concurrency=int(config.get("max_concurrency", cls.max_concurrency)),
            rate_limit=None if config.get("rate_limit") is None else float(config["rate_limit"]),
            timeout_s=float(config.get("timeout_s", cls.timeout_s)),
            max_response_chars=int(config.get("max_response_chars", cls.max_response_chars)),
        )
        if limits.max_concurrency < 1:
            raise ValueError(f"tool {tool_name!r}: config.max_concurrency must be >= 1, got {limits.max_concurrency}")
        if limits.rate_limit is not None and limits.rate_limit <= 0:
            raise ValueError(
                f"tool {tool_name!r}: config.rate_limit must be > 0 calls/s (or omitted), got {limits.rate_limit}"
            )
        if limits.timeout_s <= 0:
            raise ValueError(f"tool {tool_name!r}: config.timeout_s must be > 0, got {limits.timeout_s}")
        if limits.max_response_chars < 1:
            raise ValueError(
                f"tool {tool_name!r}: config.max_response_chars must be >= 1, got {limits.max_response_chars}"
            )
        return limits


class ToolRunner:
    """Runs one tool under its limits; safe to share across trajectories of one event loop."""

    def __init__(self, tool: BaseTool, limits: ToolLimits | None = None):
        self.tool = tool
        self.name = tool.name
        self.limits = limits or ToolLimits.from_config(tool.config, tool.name)
        self._semaphore: asyncio.Semaphore | None = None
        self._rate_lock: asyncio.Lock | None = None
        self._next_slot = 0.0
        self.num_created = 0  # instances created successfully
        self.num_released = 0  # release calls made for created instances (even if release raised)
        self.live_instances: set[str] = set()

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

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Create an instance; accepts verl's old (`id`) and new (`(id, response)`) return shapes."""
        out = await asyncio.wait_for(self.tool.create(instance_id, **create_kwargs), self.limits.timeout_s)
        new_id = out[0] if isinstance(out, tuple) else out
        if not isinstance(new_id, str) or not new_id:
            raise TypeError(
                f"tool {self.name!r}: create() returned {out!r}; return the instance id (str) or (id, ToolResponse|None)"
            )
        self.num_created += 1
        self.live_instances.add(new_id)
        return new_id

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        """Release an instance; errors and timeouts are logged, never raised."""
        if instance_id not in self.live_instances:
            logger.warning(
                "tool %r: release of unknown or already released instance %r ignored", self.name, instance_id
            )
            return
        self.live_instances.discard(instance_id)
        self.num_released += 1
        try:
            await asyncio.wait_for(self.tool.release(instance_id, **release_kwargs), self.limits.timeout_s)
        except Exception:  # noqa: BLE001 - release failures must not end the trajectory
            logger.exception("tool %r: release(%r) failed", self.name, instance_id)

    @asynccontextmanager
    async def session(
        self,
        instance_id: str | None = None,
        create_kwargs: dict[str, Any] | None = None,
        release_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[str]:
        """`async with runner.session(...) as iid:` — create, then release on any exit (cancellation too)."""
        iid = await self.create(instance_id, **(create_kwargs or {}))
        try:
            yield iid
        finally:
            # Shielded so a cancelled trajectory still releases; the release itself is time-limited.
            await asyncio.shield(self.release(iid, **(release_kwargs or {})))

    async def execute(self, instance_id: str, parameters: Any, **execute_kwargs: Any) -> ToolCallResult:
        """Run one call under the limits; never raises (except for cancellation of the caller)."""
        problems = self.tool.tool_schema.validate_arguments(parameters)
        if problems:
            msg = f"Error: invalid arguments for tool '{self.name}': " + "; ".join(problems)
            return ToolCallResult(text=msg, error="invalid_arguments: " + "; ".join(problems))
        semaphore, rate_lock = self._limiters()
        async with semaphore:
            await self._wait_rate_slot(rate_lock)
            start = time.monotonic()
            try:
                raw = await asyncio.wait_for(
                    self.tool.execute(instance_id, parameters, **execute_kwargs), self.limits.timeout_s
                )
            except TimeoutError:
                logger.warning(
                    "tool %r timed out after %.1fs (instance %s)", self.name, self.limits.timeout_s, instance_id
                )
                return ToolCallResult(
                    text=f"Error: tool '{self.name}' timed out after {self.limits.timeout_s:g}s and was stopped.",
                    error="timeout",
                    timed_out=True,
                    latency_s=time.monotonic() - start,
                )
            except Exception as exc:  # noqa: BLE001 - tool failures are data for the model
                logger.warning("tool %r raised %s: %s", self.name, type(exc).__name__, exc)
                return ToolCallResult(
                    text=f"Error: tool '{self.name}' failed: {type(exc).__name__}: {exc}",
                    error=f"{type(exc).__name__}: {exc}",
                    latency_s=time.monotonic() - start,
                )
            latency = time.monotonic() - start
        return self._to_result(raw, latency)

    def _to_result(self, raw: Any, latency: float) -> ToolCallResult:
        if not (isinstance(raw, tuple) and len(raw) == 3):
            msg = f"tool '{self.name}' returned {type(raw).__name__}; execute() must return (response, step_reward, metrics)"
            return ToolCallResult(text=f"Error: {msg}", error=msg, latency_s=latency)
        response, step_reward, metrics = raw
        if isinstance(response, str):
            response = ToolResponse(text=response)
        elif not isinstance(response, ToolResponse):
            response = ToolResponse(text=str(response))
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
        return ToolCallResult(
            text=text,
            step_reward=reward,
            metrics=dict(metrics or {}),
            truncated=truncated,
            latency_s=latency,
            response=response,
        )

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The instance's reward; a failing or hung `calc_reward` gives 0.0 and a logged error."""
        try:
            return float(
                await asyncio.wait_for(self.tool.calc_reward(instance_id, **calc_reward_kwargs), self.limits.timeout_s)
            )
        except Exception:  # noqa: BLE001
            logger.exception("tool %r: calc_reward(%r) failed; using 0.0", self.name, instance_id)
            return 0.0
