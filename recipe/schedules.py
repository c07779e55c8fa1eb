"""Schedules (`async_training.schedule`): who waits for whom between the rollout and the trainer, and the bound
on how stale a trained token may be.

- `sync`: each step rolls out, trains, then syncs the weights; every trained token was sampled by the weights the
  step trains from (bound 0).
- `one_step_off`: step k+1's prompts are rolled out in a background thread (`RolloutAhead`) while step k trains;
  the weight sync waits for that rollout. The engines, on their own pool, never idle while Megatron trains, and
  every trained token was sampled at most one weight version behind the actor (bound 1).

`recipe.trainer.Trainer.fit` drives them; `within_staleness` enforces the bound on each step's trajectories.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

# How many weight versions behind the actor a trained token may have been sampled, per schedule.
STALENESS_BOUND = {"sync": 0, "one_step_off": 1}


def within_staleness(trajs: list[Trajectory], actor_version: int, schedule: str,
                     multiple: int) -> tuple[list[Trajectory], dict[str, float]]:
    """The trajectories whose every sampled token is at most `STALENESS_BOUND[schedule]` versions behind
    `actor_version`, cut to a multiple of `multiple` (in order); `rollout/staleness/*` metrics (in versions, per
    trajectory: its oldest token). Past the bound a trajectory is dropped and counted, never trained on."""
    bound = STALENESS_BOUND[schedule]
    staleness = [actor_version - min(t.weight_versions, default=actor_version) for t in trajs]
    kept = [t for t, s in zip(trajs, staleness) if s <= bound]
    if len(kept) < len(trajs):
        logger.warning("%d trajectories sampled more than %d weight version(s) ago dropped (staleness bound of "
                       "async_training.schedule=%s)", len(trajs) - len(kept), bound, schedule)
    kept = kept[: len(kept) - len(kept) % multiple]
    values = torch.tensor(staleness or [0], dtype=torch.float32)
    return kept, {"rollout/staleness/mean": float(values.mean()), "rollout/staleness/max": float(values.max()),
                  "rollout/staleness/bound": float(bound), "rollout/staleness/dropped": float(len(trajs) - len(kept))}


class RolloutAhead:
    """At most one rollout running in a background thread (one_step_off's next step) while the caller trains."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._future: Future | None = None

    @property
    def pending(self) -> bool:
        """A rollout was started and not joined yet."""
        return self._future is not None

    def start(self, collect: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run `collect(*args, **kwargs)` in the background thread."""
        assert self._future is None, "one rollout ahead at a time"
        self._future = self._pool.submit(collect, *args, **kwargs)

    def join(self) -> Any:
        """Wait for the rollout; its result (or its exception)."""
        future, self._future = self._future, None
        return future.result()

    def abort(self, agent_loop: Any, loop: asyncio.AbstractEventLoop) -> None:
        """The caller failed while the rollout runs: abort it on its event loop (tools released, interactions
        finalized) and wait for it to end."""
        if self._future is None:
            return
        if not self._future.done():
            asyncio.run_coroutine_threadsafe(agent_loop.abort(), loop)
        try:
            self.join()
        except Exception:  # noqa: BLE001 - the caller's own error is the one raised
            logger.exception("the rollout ahead failed while it was aborted")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
