"""Routing of generate requests across many engines: least-loaded, sticky per trajectory.

The first request of a trajectory goes to the engine with the fewest requests in flight
(counted here, at the router, so that requests issued in the same event-loop tick already
count); every later turn of that trajectory goes to the same engine, whose radix cache still
holds the conversation's prefix. The router also remembers every request in flight so that
`abort_all` can stop them all, on whichever engine they run.

Departs from a plain round-robin load balancer: stickiness is per trajectory (not per
prompt), because the `n` samples of one prompt diverge after the first turn and spreading
them balances load better than keeping them together.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollout.engines.base import GenerateResult, RolloutEngine

logger = logging.getLogger(__name__)


class EngineRouter:
    """Least-loaded, sticky-per-trajectory routing over `engines`."""

    def __init__(self, engines: list[RolloutEngine]):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine; launch one EngineClient per rollout replica")
        self.engines = list(engines)
        self._inflight = [0] * len(self.engines)  # requests in flight per engine, counted by the router
        self._sticky: dict[str, int] = {}  # trajectory uid -> engine index
        self._requests: dict[str, int] = {}  # request id in flight -> engine index

    def engine_for(self, trajectory_uid: str) -> int:
        """Index of the engine serving `trajectory_uid` (chosen least-loaded on first use)."""
        idx = self._sticky.get(trajectory_uid)
        if idx is None:
            idx = min(range(len(self.engines)), key=lambda i: (self._inflight[i], self._assigned(i)))
            self._sticky[trajectory_uid] = idx
        return idx

    def _assigned(self, i: int) -> int:
        return sum(1 for v in self._sticky.values() if v == i)

    async def generate(
        self, trajectory_uid: str, input_ids: list[int], sampling_params: dict[str, Any], request_id: str
    ) -> GenerateResult:
        """Run one request on the trajectory's engine."""
        idx = self.engine_for(trajectory_uid)
        self._inflight[idx] += 1
        self._requests[request_id] = idx
        try:
            return await self.engines[idx].generate(input_ids, sampling_params, request_id)
        except asyncio.CancelledError:
            # The caller gave up (abort): stop the engine's work too, not just our wait for it.
            try:
                await asyncio.shield(self.engines[idx].abort(request_id))
            except Exception:  # noqa: BLE001 - the abort is best effort; the cancellation goes on
                logger.exception("aborting request %s on engine %s failed", request_id, self.engines[idx].name)
            raise
        finally:
            self._inflight[idx] -= 1
            self._requests.pop(request_id, None)

    async def abort_all(self) -> None:
        """Abort every request in flight on every engine."""
        pending = list(self._requests.items())
        if pending:
            logger.info("aborting %d in-flight engine requests", len(pending))
        await asyncio.gather(*(self.engines[i].abort(rid) for rid, i in pending), return_exceptions=True)

    def release(self, trajectory_uid: str) -> None:
        """Forget a finished trajectory's engine (its next use is routed afresh)."""
        self._sticky.pop(trajectory_uid, None)
