"""Faults during a run: dead engines restarted and resynced, and steps that train nothing (docs/faults.md).

- After every rollout (and when a weight sync fails) each engine answers a one-token health probe; a dead engine
  (actor died, or probe past `rollout.engine_health_timeout_s`) is restarted on its bundle, synced to the current
  weight version with the checksum check, and only then routed to again; the agent loop already retried its
  trajectories on live engines. An engine dying with no restart left (`rollout.max_engine_restarts`) aborts the
  rollout and stops the run (`RunFailed`).
- A step with more than `trainer.max_failed_fraction` of its trajectories in error, or none trainable, is not
  trained on; `trainer.max_failed_steps` such steps in a row stop the run.
- `fault/*` metrics count restarts, retried trajectories and skipped steps since the process started.

The probe generates a token, so it needs the engines' KV cache: colocated engines get it back first (`heal`), since
a probe into released KV memory would fail on every engine, not only the dead one.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from recipe.colocation import GpuHandover
from recipe.config_schema import PPOConfig
from rollout.engines.base import EngineDeadError
from rollout.trajectory import FinishReason, Trajectory

logger = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot go on (an engine died with no restart left, too many steps in a row trained nothing, dynamic
    sampling ran out of prompt batches); the message is one line naming what failed and the key that allows more."""


class EngineFaults:
    """Restarts dead engines (at most `max_engine_restarts` each) and counts the run's faults."""

    def __init__(self, cfg: PPOConfig, agent_loop: Any, workers: Any, handover: GpuHandover,
                 run: Callable[[Any], Any], version: Callable[[], int]) -> None:
        """`workers`: the trainer's (their weight sync restores a restarted engine); `run` runs a coroutine on the
        rollout's event loop; `version()` is the engines' current weight version."""
        self.cfg, self.agent_loop, self.workers, self.handover, self.run = cfg, agent_loop, workers, handover, run
        self.version = version
        self.router = agent_loop.router
        self.restarts = [0] * len(self.router.engines)  # restarts so far, per engine
        self.counts = {"fault/engine_restarts": 0.0, "fault/retried_trajectories": 0.0, "fault/skipped_steps": 0.0}
        self.failed_steps_in_row = 0  # steps in a row that trained nothing
        self._fatal: RunFailed | None = None  # an engine died with no restart left: raised once the rollout ends
        self._aborting: asyncio.Future | None = None
        self.router.on_dead = self._engine_died

    def metrics(self) -> dict[str, float]:
        self.counts["fault/retried_trajectories"] = float(self.agent_loop.retried)
        return dict(self.counts)

    def _engine_died(self, idx: int, error: EngineDeadError) -> None:
        """The router's `on_dead` (in the rollout's event loop): with no restart left, abort the rollout now."""
        allowed = self.cfg.actor_rollout_ref.rollout.max_engine_restarts
        if self.restarts[idx] < allowed or self._fatal is not None:
            return
        used = f"all {allowed} restarts used" if allowed else "restarts are off"
        self._fatal = RunFailed(f"{error}; {used} (actor_rollout_ref.rollout.max_engine_restarts={allowed}): "
                                "stopping the run")
        self._aborting = asyncio.ensure_future(self.agent_loop.abort())

    def raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def heal(self, version: int | None = None) -> dict[str, float] | None:
        """Probe every engine; restart each dead one on its bundle, then sync the engines to `version` (default: the
        current one) with the
        checksum check before the router uses them again (RunFailed when one has no restart left); the sync's
        metrics, or None when every engine was alive."""
        r = self.cfg.actor_rollout_ref.rollout
        self.raise_if_fatal()
        self.handover.resume_kv_cache_of_live()  # the probe generates: it needs the KV cache the colocated engines released
        self.run(self.router.probe(r.engine_health_timeout_s))
        self.raise_if_fatal()
        dead = sorted(self.router.dead)
        if not dead:
            return None
        engines = [self.router.engines[i] for i in dead]
        for idx, engine in zip(dead, engines):
            self.restarts[idx] += 1
            self.counts["fault/engine_restarts"] += 1
            logger.warning("%s; restarting it (restart %d of actor_rollout_ref.rollout.max_engine_restarts=%d)",
                           self.router.dead[idx], self.restarts[idx], r.max_engine_restarts)
            try:
                engine.restart()
                self.handover.match_released(engine)  # colocated mid-step: hold only what the others hold
            except Exception as e:
                raise RunFailed(f"engine {engine.name}: restart failed: {type(e).__name__}: {e}") from e
        version = self.version() if version is None else version
        self.workers.weight_sync.forget_groups(engines)
        metrics = self.workers.weight_sync.sync(version, check=True)
        for idx, engine in zip(dead, engines):
            self.router.revive(idx)
            logger.warning("engine %s restarted, synced to weight version %d and checked", engine.name, version)
        return metrics

    def step_trained(self) -> None:
        self.failed_steps_in_row = 0

    def skip_step(self, step: int, rolled: list[Trajectory], failed: float) -> RunFailed | None:
        """Count a step that trains nothing and say why; the error that stops the run (raised by the caller once the
        step is logged) when it is the trainer.max_failed_steps-th in a row."""
        t = self.cfg.trainer
        self.failed_steps_in_row += 1
        self.counts["fault/skipped_steps"] += 1
        reason = (f"{failed:.0%} of its trajectories ended in error (more than trainer.max_failed_fraction="
                  f"{t.max_failed_fraction})" if failed > t.max_failed_fraction else
                  "no trajectory to train on (none with a sampled token, or all past the staleness bound)")
        errors = [x.error for x in rolled if x.finish_reason is FinishReason.ERROR and x.error]
        first = f"; first error: {errors[0]}" if errors else ""
        logger.warning("step %d: %s; not training on it (%d such step(s) in a row of trainer.max_failed_steps=%d)%s",
                       step, reason, self.failed_steps_in_row, t.max_failed_steps, first)
        if self.failed_steps_in_row < t.max_failed_steps:
            return None
        return RunFailed(f"{self.failed_steps_in_row} steps in a row trained nothing (step {step}: {reason}{first}); "
                         f"stopping the run (trainer.max_failed_steps={t.max_failed_steps})")
