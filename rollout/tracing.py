"""`rollout_trace_op`: verl's tracing decorator (`verl.utils.rollout_trace.rollout_trace_op`),
recording into the trajectory being rolled out.

Decorate a tool's or interaction's method (sync or async) with it, as verl's tools do:

    from rollout.tracing import rollout_trace_op        # verl: from verl.utils.rollout_trace import ...

    class MyTool(BaseTool):
        @rollout_trace_op
        async def execute(self, instance_id, parameters, **kwargs): ...

Each call made while a trajectory is active appends one record to that trajectory's `traces`
(written with it to `trainer.rollout_data_dir`): `{"name", "args", "kwargs", "result",
"duration_s"}` (and `"error"` when it raised), every value in plain JSON form. The agent loop
marks a trajectory active with `trace_into(traj.traces)` (a context variable, so the concurrent
trajectories of one event loop each record their own calls); outside one, a call is not recorded.

Departs from verl: verl sends these to Weave / MLflow when configured (and records nothing
otherwise); here they always land in the trajectory dump. `self` is not recorded.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_ACTIVE: ContextVar[list[dict[str, Any]] | None] = ContextVar("rollout_trace", default=None)


@contextmanager
def trace_into(records: list[dict[str, Any]]) -> Iterator[None]:
    """Record the `rollout_trace_op` calls made in this context (and tasks it starts) into `records`."""
    token = _ACTIVE.set(records)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def to_plain(value: Any) -> Any:
    """`value` as plain JSON data: pydantic models dumped, containers walked, anything else as its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "model_dump"):
        return to_plain(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return repr(value)


def _record(records: list[dict[str, Any]], fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
            start: float, result: Any = None, error: BaseException | None = None) -> None:
    if args and next(iter(inspect.signature(fn).parameters), None) == "self":
        args = args[1:]  # a method: leave `self` out
    entry = {"name": fn.__qualname__, "args": to_plain(list(args)), "kwargs": to_plain(kwargs),
             "result": to_plain(result), "duration_s": time.monotonic() - start}
    if error is not None:
        entry["error"] = f"{type(error).__name__}: {error}"
    records.append(entry)


def rollout_trace_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Record each call of `fn` (name, arguments, result, duration) on the active trajectory."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            records, start = _ACTIVE.get(), time.monotonic()
            if records is None:
                return await fn(*args, **kwargs)
            try:
                result = await fn(*args, **kwargs)
            except Exception as exc:
                _record(records, fn, args, kwargs, start, error=exc)
                raise
            _record(records, fn, args, kwargs, start, result)
            return result
        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        records, start = _ACTIVE.get(), time.monotonic()
        if records is None:
            return fn(*args, **kwargs)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            _record(records, fn, args, kwargs, start, error=exc)
            raise
        _record(records, fn, args, kwargs, start, result)
        return result
    return wrapper
