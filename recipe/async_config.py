"""`async_training.*`: whether rollout and training overlap, and how stale a trained token may be (the schedules:
recipe/schedules.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from recipe.config_build import ConfigError

SCHEDULES = ("sync", "one_step_off", "fully_async")
STALE_POLICIES = ("drop", "regenerate")
_FIXED_BOUNDS = {"sync": 0, "one_step_off": 1}  # staleness bounds the schedule itself holds
# Read by fully_async only: another schedule refuses any value but their default (it would ignore it silently).
_FULLY_ASYNC_ONLY = ("staleness_threshold", "trigger_parameter_sync_step", "partial_rollout")


@dataclass
class AsyncTrainingConfig:
    """`async_training.*`: whether rollout and training overlap (recipe.trainer `fit`)."""

    schedule: str = "sync"
    """sync: each step rolls out, trains, then syncs the weights, so every trained token was sampled by the weights
    it trains from. one_step_off: step k+1's rollout runs while step k trains, on the weights before step k's update
    (every trained token at most one version behind; the engines need their own pool:
    actor_rollout_ref.hybrid_engine=false). fully_async: a streaming rollouter keeps the engines full, prompt group
    after prompt group, and each step trains on the first data.train_batch_size groups to finish (own pool too)."""
    staleness_threshold: float = 0.1
    """fully_async (verl's key, meaning and default): how far the rollouter may run ahead of the trainer. At most
    (1 + staleness_threshold) x trigger_parameter_sync_step x data.train_batch_size prompt groups are started and not
    yet taken by the trainer."""
    trigger_parameter_sync_step: int = 1
    """fully_async (verl's key): trainer steps between two weight syncs into the engines. A step here trains on
    data.train_batch_size groups (verl's fully async trainer steps on require_batches mini-batches, hence its
    default of 4)."""
    partial_rollout: bool = True
    """fully_async (verl's key): at a weight sync, generations in flight are paused and continue on the new weights
    (their turn's tokens then carry two versions); false: the sync waits for every started group to finish."""
    staleness_bound: int | None = None
    """How many weight versions behind the actor a trained token may have been sampled; a prompt group with an older
    token is handled by stale_policy and counted (rollout/staleness/*). None: the schedule's own bound (sync 0,
    one_step_off 1, fully_async 2 x trigger_parameter_sync_step: a group may have started two syncs ago); only
    fully_async may set another."""
    stale_policy: str = "drop"
    """What happens to a prompt group past the staleness bound: drop (not trained on) or regenerate (fully_async: its
    prompt is rolled out again, first in line)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"async_training.schedule={self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if self.stale_policy not in STALE_POLICIES:
            raise ConfigError(f"async_training.stale_policy={self.stale_policy!r}; use one of "
                              f"{', '.join(STALE_POLICIES)}")
        if self.trigger_parameter_sync_step < 1:
            raise ConfigError(f"async_training.trigger_parameter_sync_step={self.trigger_parameter_sync_step}; it must "
                              "be >= 1")
        if self.staleness_threshold < 0:
            raise ConfigError(f"async_training.staleness_threshold={self.staleness_threshold}; it must be >= 0")
        if self.schedule != "fully_async":
            ignored = [f"async_training.{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                       if f.name in _FULLY_ASYNC_ONLY and getattr(self, f.name) != f.default]
            if ignored:
                raise ConfigError(f"{', '.join(ignored)}: only async_training.schedule=fully_async reads it, and "
                                  f"{self.schedule} would ignore it; set async_training.schedule=fully_async (verl's "
                                  "fully_async_main: --config-name fully_async_ppo_megatron_trainer), or drop the key")
            if self.staleness_bound is not None:
                raise ConfigError(f"async_training.staleness_bound is fixed by async_training.schedule={self.schedule} "
                                  f"({_FIXED_BOUNDS[self.schedule]}); drop the key, or use "
                                  "async_training.schedule=fully_async")
            if self.stale_policy == "regenerate":
                raise ConfigError(f"async_training.stale_policy=regenerate needs async_training.schedule=fully_async "
                                  f"(in {self.schedule} no token passes its bound); drop the key")
        elif self.staleness_bound is not None and self.staleness_bound < 0:
            raise ConfigError(f"async_training.staleness_bound={self.staleness_bound}; it must be >= 0")

    @property
    def bound(self) -> int:
        """The staleness bound in weight versions (`staleness_bound`, or the schedule's own)."""
        if self.staleness_bound is not None:
            return self.staleness_bound
        return _FIXED_BOUNDS.get(self.schedule, 2 * self.trigger_parameter_sync_step)

    @property
    def separate_pool(self) -> bool:
        """Whether the schedule rolls out while the trainer trains (the engines need GPUs of their own)."""
        return self.schedule != "sync"
