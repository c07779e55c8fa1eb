"""Routing of generate requests across many engines: least-loaded, sticky per trajectory.

The first request of a trajectory goes to the engine with the fewest requests in flight
(counted here, at the router, so that requests issued in the same event-loop tick already
count); every later turn of that trajectory goes to the same engine, whose radix cache still
holds the conversation's prefix. The router also remembers every request in flight so that
`abort_all` can stop them all, on whichever engine they run.

An engine whose `generate` raises `EngineDeadError` is marked dead: no request is routed to it
until `revive` (after its restart); `on_dead`, when set, is told once per death (the trainer
decides there whether the engine can be restarted). With every engine dead, routing raises
`EngineDeadError` at once instead of waiting. `probe` sends every engine a one-token request
under a timeout and marks the ones that fail it dead.

`pause` / `resume` bracket a weight update that lands while trajectories run (partial rollout,
`async_training.partial_rollout`): new requests wait, the ones in flight are aborted and return
what they sampled with `meta["paused"]`, so their callers continue them, on the new weights, once
`resume` lets requests through again. `busy_seconds` is the wall time with some request in flight.

Departs from a plain round-robin load balancer: stickiness is per trajectory (not per
prompt), because the `n` samples of one prompt diverge after the first turn and spreading
them balances load better than keeping them together.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from rollout.engines.base import EngineDeadError, GenerateResult, RolloutEngine

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
        self.dead: dict[int, EngineDeadError] = {}  # engine index -> what killed it (until `revive`)
        self.on_dead: Callable[[int, EngineDeadError], None] | None = None  # told once per death
        self.paused = False  # between `pause` and `resume`: requests wait
        self._resumed: asyncio.Event | None = None  # set by `resume` (made in `pause`, on the loop that waits on it)
        self._busy_s, self._busy_since = 0.0, None  # wall time with a request in flight; when the current spell began

    def engine_for(self, trajectory_uid: str) -> int:
        """Index of the engine serving `trajectory_uid` (chosen least-loaded on first use)."""
        idx = self._sticky.get(trajectory_uid)
        if idx is None or idx in self.dead:
            live = [i for i in range(len(self.engines)) if i not in self.dead]
            if not live:
                raise EngineDeadError("(all)", "every engine is dead: " + "; ".join(map(str, self.dead.values())))
            idx = min(live, key=lambda i: (self._inflight[i], self._assigned(i)))
            self._sticky[trajectory_uid] = idx
        return idx

    def mark_dead(self, idx: int, error: EngineDeadError) -> None:
        """Route nothing more to engine `idx`; tell `on_dead` (once per death)."""
        if idx in self.dead:
            return
        logger.error("%s; routing around it", error)
        self.dead[idx] = error
        if self.on_dead is not None:
            self.on_dead(idx, error)

    def has_live(self) -> bool:
        """Whether some engine is not marked dead."""
        return len(self.dead) < len(self.engines)

    async def probe(self, timeout_s: float) -> None:
        """Health probe: every engine not already marked dead generates one token within `timeout_s` seconds, or
        is marked dead (a dead actor, or a scheduler that no longer answers)."""
        async def one(idx: int) -> None:
            engine = self.engines[idx]
            try:
                await asyncio.wait_for(engine.generate([0], {"max_new_tokens": 1, "temperature": 0.0},
                                                       f"health-{uuid.uuid4().hex}"), timeout_s)
            except TimeoutError:
                self.mark_dead(idx, EngineDeadError(engine.name, f"no answer to a health probe within {timeout_s:g} s "
                                                                 "(actor_rollout_ref.rollout.engine_health_timeout_s)"))
            except EngineDeadError as e:
                self.mark_dead(idx, e)

        await asyncio.gather(*(one(i) for i in range(len(self.engines)) if i not in self.dead))

    def revive(self, idx: int) -> None:
        """Engine `idx` serves again (restarted and synced)."""
        self.dead.pop(idx, None)

    def _assigned(self, i: int) -> int:
        return sum(1 for v in self._sticky.values() if v == i)

    async def generate(
        self, trajectory_uid: str, input_ids: list[int], sampling_params: dict[str, Any], request_id: str
    ) -> GenerateResult:
        """Run one request on the trajectory's engine (after `resume`, while paused). A request that `pause` aborted
        returns finish_reason "abort" with `meta["paused"]` set: the caller continues it after the update."""
        while self.paused:
            await self._resumed.wait()
        idx = self.engine_for(trajectory_uid)
        if not self._requests:
            self._busy_since = time.monotonic()
        self._inflight[idx] += 1
        self._requests[request_id] = idx
        try:
            res = await self.engines[idx].generate(input_ids, sampling_params, request_id)
            if res.finish_reason == "abort" and self.paused:
                res.meta["paused"] = True
            return res
        except EngineDeadError as e:
            self.mark_dead(idx, e)
            raise
        except asyncio.CancelledError:
            # The caller gave up (abort): stop the engine's work too, not just our wait for it.
            try:
                if idx not in self.dead:
                    await asyncio.shield(self.engines[idx].abort(request_id))
            except Exception:  # noqa: BLE001 - the abort is best effort; the cancellation goes on
                logger.exception("aborting request %s on engine %s failed", request_id, self.engines[idx].name)
            raise
        finally:
            self._inflight[idx] -= 1
            self._requests.pop(request_id, None)
            if not self._requests:
                self._busy_s += time.monotonic() - self._busy_since

    def busy_seconds(self) -> float:
        """Wall time so far with at least one request in flight on some engine."""
        return self._busy_s + (time.monotonic() - self._busy_since if self._requests else 0.0)

    async def pause(self) -> None:
        """Hold new requests and abort those in flight; returns once none is in flight (the engines are idle and
        every paused request's caller holds what it sampled)."""
        if self._resumed is None or self._resumed.is_set():
            self._resumed = asyncio.Event()
        self.paused = True
        while self._requests:  # an abort can reach an engine before its request does: repeat until none is left
            await self.abort_all()
            await asyncio.sleep(0.02)

    def resume(self) -> None:
        """Let requests through again (after the weight update)."""
        self.paused = False
        if self._resumed is not None:
            self._resumed.set()

    async def abort_all(self) -> None:
        """Abort every request in flight on every engine."""
        pending = list(self._requests.items())
        if pending:
            logger.info("aborting %d in-flight engine requests", len(pending))
        await asyncio.gather(*(self.engines[i].abort(rid) for rid, i in pending if i not in self.dead),
                             return_exceptions=True)

    def release(self, trajectory_uid: str) -> None:
        """Forget a finished trajectory's engine (its next use is routed afresh)."""
        self._sticky.pop(trajectory_uid, None)
