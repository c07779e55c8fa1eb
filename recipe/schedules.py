"""Schedules (`async_training.schedule`): who waits for whom between the rollout and the trainer, and the bound
on how stale a trained token may be.

- `sync`: each step rolls out, trains, then syncs the weights; every trained token was sampled by the weights the
  step trains from (bound 0).
- `one_step_off`: step k+1's prompts are rolled out in a background thread (`RolloutAhead`) while step k trains;
  the weight sync waits for that rollout. The engines, on their own pool, never idle while Megatron trains, and
  every trained token was sampled at most one weight version behind the actor (bound 1).
- `fully_async`: a `StreamingRollouter` rolls out prompt group after prompt group on the trainer's event loop, in a
  thread of its own, keeping at most (1 + staleness_threshold) x trigger_parameter_sync_step x train_batch_size
  groups started and not yet taken; each step takes the first train_batch_size groups to finish. Every
  trigger_parameter_sync_step steps the weights are synced: with partial_rollout the generations in flight are
  paused (`EngineRouter.pause`) and continue on the new weights, else the sync waits for the started groups. A
  long tool call or a slow simulated user can keep a group across several syncs, so the bound (in actor updates,
  `async_training.staleness_bound`) is enforced on each group's oldest token when it is taken: past it, the group
  is dropped or its prompt rolled out again (`stale_policy`), and counted.

The schedules differ only in how they feed `recipe.trainer.Trainer.step` (`collect`) and when it syncs (`syncs`,
`before_sync`, `after_sync`); `within_staleness` enforces the bound on each step's trajectories. The background
rollouts themselves are in `recipe.rollouter`.

Departs from verl's fully async trainer: staleness is bounded on tokens (each carries the version that sampled
it), not only by how far the rollouter runs ahead.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from recipe.config_schema import PPOConfig
from recipe.engine_faults import RunFailed
from recipe.group_filter import trainable
from recipe.rollouter import RolloutAhead, RolloutStopped, StreamingRollouter
from recipe.rollouts import Collected, Draw, Rollouts
from rollout.metrics import rollout_metrics
from rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)


def staleness(traj: Trajectory, actor_version: int) -> int:
    """Weight versions between `actor_version` and the oldest token `traj` sampled (0 with none sampled)."""
    return actor_version - min(traj.weight_versions, default=actor_version)


def within_staleness(trajs: list[Trajectory], actor_version: int, bound: int,
                     multiple: int) -> tuple[list[Trajectory], dict[str, float]]:
    """The trajectories of the prompt groups whose every sampled token is at most `bound` versions behind
    `actor_version`, cut to a multiple of `multiple` (in order); `rollout/staleness/*` metrics (in versions, per
    trajectory: its oldest token). A group with a token past the bound is dropped and counted, never trained on."""
    values = [staleness(t, actor_version) for t in trajs]
    stale = {t.prompt_uid for t, s in zip(trajs, values) if s > bound}
    kept = [t for t in trajs if t.prompt_uid not in stale]
    if stale:
        logger.warning("%d prompt group(s) with tokens sampled more than %d weight version(s) ago dropped "
                       "(async_training.staleness_bound)", len(stale), bound)
    kept = kept[: len(kept) - len(kept) % multiple]
    v = torch.tensor(values or [0], dtype=torch.float32)
    return kept, {"rollout/staleness/mean": float(v.mean()), "rollout/staleness/max": float(v.max()),
                  "rollout/staleness/bound": float(bound), "rollout/staleness/dropped": float(len(trajs) - len(kept))}


class SyncSchedule:
    """sync: each step rolls out its own prompts, trains, and syncs after every actor update."""

    def __init__(self, cfg: PPOConfig, rollouts: Rollouts, total_steps: int, actor_version: Callable[[], int]) -> None:
        """`actor_version()`: the actor's weight version, counting updates not synced yet."""
        self.cfg, self.rollouts, self.total_steps, self.actor_version = cfg, rollouts, total_steps, actor_version

    def collect(self, step: int, draw: Draw) -> Collected:
        """Step `step`'s rollout, drawing prompt batches from `draw`."""
        return self.rollouts.collect(draw(), step, draw)

    def syncs(self, step: int) -> bool:
        """Whether step `step` ends with a weight sync (when it updated the actor)."""
        return True

    def before_sync(self) -> None:
        """Let a weight sync happen: the rollout in flight waits for it, or is waited for."""

    def after_sync(self) -> None:
        """The weight sync is done: the rollout in flight goes on."""

    def step_done(self) -> None:
        """The step trained or was skipped; nothing of its rollout is still running."""

    def snapshot(self, cursor: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
        """For a checkpoint: {file name: what the schedule keeps between steps} and `cursor()` read where prompt
        batches are drawn."""
        return {}, cursor()

    def restore(self, files: dict[str, Any]) -> None:
        """Before the first step of a resumed run: what `snapshot` saved (by file name)."""

    def close(self) -> None:
        """Stop what runs in the background (after an error too: aborted, tools released)."""


class OneStepOff(SyncSchedule):
    """one_step_off: step k+1's prompts roll out in a background thread while step k trains; the weight sync waits
    for that rollout, which step k+1 then trains on."""

    FILE = "rollout_ahead.pkl"  # in a checkpoint: the next step's rollout, done (a pickled Collected)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pool = RolloutAhead()
        self.done: Collected | None = None  # the next step's rollout, finished

    def collect(self, step: int, draw: Draw) -> Collected:
        collected, self.done = self.done or self.rollouts.collect(draw(), step, draw), None
        if step < self.total_steps:
            self.pool.start(self.rollouts.collect, draw(), step + 1, draw, in_background=True)
        return collected

    def before_sync(self) -> None:
        """Wait for the rollout ahead, then restart the dead engines (which the background rollout leaves to this
        thread: a restart syncs weights from the actor)."""
        if self.pool.pending:
            self.done = self.pool.join()
            self.rollouts.faults.heal()

    def step_done(self) -> None:
        self.before_sync()  # a step that synced nothing (skipped, or critic warm-up) joins here

    def snapshot(self, cursor: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
        return ({self.FILE: self.done} if self.done is not None else {}), cursor()

    def restore(self, files: dict[str, Any]) -> None:
        self.done = files.get(self.FILE)

    def close(self) -> None:
        self.pool.abort(self.rollouts.agent_loop, self.rollouts.loop)
        self.pool.close()


class FullyAsync(SyncSchedule):
    """fully_async: a streaming rollouter keeps the engines full while each step trains on the first groups to finish;
    the weights are synced every `trigger_parameter_sync_step` steps (and before a checkpoint)."""

    FILE = "stream.pkl"  # in a checkpoint: (finished groups not taken, prompts in flight or drawn)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.stream: StreamingRollouter | None = None  # started by the first `collect`
        self.restored: tuple | None = None  # what a checkpoint saved of the stream

    def collect(self, step: int, draw: Draw) -> Collected:
        if self.stream is None:
            a = self.cfg.async_training
            capacity = math.ceil((1 + a.staleness_threshold) * a.trigger_parameter_sync_step *
                                 self.cfg.data.train_batch_size)
            self.stream = StreamingRollouter(self.rollouts.agent_loop, self.rollouts.loop, lambda: draw().prompts,
                                             capacity, seed=self.rollouts.seed(0))
            if self.restored is not None:
                self.stream.restore(*self.restored)
            self.stream.start()
        return self._take(step)

    def syncs(self, step: int) -> bool:
        t, every = self.cfg.trainer, self.cfg.async_training.trigger_parameter_sync_step
        saves = t.save_freq > 0 and step % t.save_freq == 0
        return saves or step == self.total_steps or step % every == 0

    def before_sync(self) -> None:
        """The engines idle (generations paused, or the started groups finished), and the dead ones restarted."""
        if self.cfg.async_training.partial_rollout:
            self.stream.pause()
        else:
            self.stream.drain()
        self.rollouts.faults.heal()

    def after_sync(self) -> None:
        self.stream.resume()

    def snapshot(self, cursor: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
        if self.stream is None:
            return ({self.FILE: self.restored} if self.restored is not None else {}), cursor()
        state, position = self.stream.snapshot(cursor)  # read on the rollouter's loop, where it draws prompts
        return {self.FILE: state}, position

    def restore(self, files: dict[str, Any]) -> None:
        self.restored = files.get(self.FILE)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.stop()
            self.stream = None

    def _take(self, step: int) -> Collected:
        """The next `data.train_batch_size` finished groups within the staleness bound (past it: dropped, or rolled
        out again) and, under dynamic sampling, with a signal."""
        a, groups, faults = self.cfg.async_training, self.rollouts.groups, self.rollouts.faults
        actor_version, rolled, kept = self.actor_version(), [], []
        counts = {"stale": 0, "regenerated": 0, "filtered": 0, "taken": 0}
        t0 = time.monotonic()
        while len(kept) < groups.want:
            if groups.enabled and groups.exhausted(counts["taken"] / groups.want):
                raise groups.too_uniform(step, len(kept), counts["taken"] / groups.want)
            try:
                prompt, group = self.stream.take(self.cfg.trainer.rollout_timeout_s, check=faults.raise_if_fatal)
            except (RolloutStopped, TimeoutError) as e:
                raise RunFailed(f"step {step}: {e}; stopping the run") from e
            counts["taken"] += 1
            rolled += group
            if any(staleness(x, actor_version) > a.bound for x in group):
                counts["regenerated" if a.stale_policy == "regenerate" else "stale"] += 1
                if a.stale_policy == "regenerate":
                    self.stream.requeue([prompt])
            elif groups.keeps(group):
                kept.append(group)
            else:
                counts["filtered"] += 1
        metrics = {**rollout_metrics(rolled), "timing/wait_groups_s": time.monotonic() - t0,
                   "rollout/staleness/dropped_groups": float(counts["stale"]),
                   "rollout/staleness/regenerated_groups": float(counts["regenerated"]),
                   "rollout/staleness/taken_mean": sum(staleness(x, actor_version) for x in rolled) / len(rolled)}
        if groups.enabled:
            metrics.update(groups.metrics(len(kept), counts["filtered"], counts["taken"] / groups.want))
        trajs = trainable([t for group in kept for t in group], self.rollouts.row_multiple)
        return Collected(rolled, trajs, metrics, in_background=True)


SCHEDULES: dict[str, type[SyncSchedule]] = {"sync": SyncSchedule, "one_step_off": OneStepOff,
                                            "fully_async": FullyAsync}
