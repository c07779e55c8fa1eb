"""A step's rollout: prompts through the agent loop, dynamic sampling, ReMax's greedy baselines -> `Collected`.

The rollout runs on one persistent asyncio loop owned by the trainer (tools keep per-loop state). A rollout past
`trainer.rollout_timeout_s`, or one still running when the trainer closes, is aborted (`AgentLoop.abort`); the step
trains on what was sampled. After each rollout the engines are probed and the dead ones restarted
(`recipe.engine_faults`), except in a rollout running in the background (one_step_off), which leaves that to the
trainer's thread. ReMax's baseline is a greedy rollout of each prompt through the same agent loop (tools and
interactions included), rewarded like the samples; it is not trained on.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recipe.config_schema import PPOConfig
from recipe.data.dataset import PromptBatch
from recipe.engine_faults import EngineFaults
from recipe.group_filter import GroupFilter, failed_fraction, prompt_groups, trainable
from recipe.reward import RewardFn
from recipe.rollouter import run_on
from recipe.step_metrics import Timer
from rollout.agent_loop import AgentLoop
from rollout.metrics import rollout_metrics
from rollout.prompt import RolloutPrompt
from rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

Draw = Callable[[], PromptBatch]  # the next prompt batch


@dataclass
class Collected:
    """One step's rollout, ready to train on."""

    rolled: list[Trajectory]  # everything rolled out (under dynamic sampling: every prompt batch)
    trajs: list[Trajectory]  # what the step trains on: trainable, in kept groups, a multiple of the batch split
    metrics: dict[str, float]  # rollout metrics and timings (timing/rollout_s, fault/failed_fraction, ...)
    in_background: bool = False  # rolled out while the previous step trained (one_step_off, fully_async)
    baselines: dict[str, float] | None = None  # ReMax: prompt uid -> its greedy rollout's weighted total reward
    failed: float = field(init=False)  # the share of `rolled` that ended in error

    def __post_init__(self) -> None:
        self.failed = self.metrics["fault/failed_fraction"] = failed_fraction(self.rolled)

    def trains(self, max_failed_fraction: float) -> bool:
        """Whether a step trains on it: some trajectory to train on, and not too many failed."""
        return bool(self.trajs) and self.failed <= max_failed_fraction


async def rollout_with_timeout(agent_loop: AgentLoop, prompts: list[RolloutPrompt], timeout_s: float | None,
                               greedy: bool = False, seed: int | None = None,
                               over_sample_rate: float = 0.0) -> list[Trajectory]:
    """`agent_loop.generate(prompts)`, aborted after `timeout_s` seconds (None: no limit); returns what was produced."""
    task = asyncio.ensure_future(agent_loop.generate(prompts, greedy=greedy, seed=seed,
                                                     over_sample_rate=over_sample_rate))
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        logger.warning("the rollout ran past trainer.rollout_timeout_s=%s; aborting it and training on what it "
                       "sampled", timeout_s)
        await agent_loop.abort()
    return await task


class Rollouts:
    """Rolls out prompt batches on the trainer's event loop and turns them into what a step trains on."""

    def __init__(self, cfg: PPOConfig, agent_loop: AgentLoop, loop: asyncio.AbstractEventLoop, faults: EngineFaults,
                 reward_fn: RewardFn, groups: GroupFilter, row_multiple: int) -> None:
        self.cfg, self.agent_loop, self.loop, self.faults = cfg, agent_loop, loop, faults
        self.reward_fn, self.groups, self.row_multiple = reward_fn, groups, row_multiple

    def run(self, coro: Any) -> Any:
        return run_on(self.loop, coro)

    def seed(self, step: int, gen: int = 0) -> int | None:
        """The agent loop's seed for prompt batch `gen` of step `step` (a function of trainer.seed, the step and the
        batch only, so a resumed run samples what the uninterrupted one did); None unless rollout.deterministic."""
        if not self.cfg.actor_rollout_ref.rollout.deterministic:
            return None
        return self.cfg.trainer.seed * 1_000_003 + step + gen * 7_777_777

    def rollout(self, prompts: list[RolloutPrompt], *, greedy: bool = False, seed: int | None = None,
                heal: bool = True) -> list[Trajectory]:
        """The agent loop's rollout of `prompts`, then (`heal`) every engine probed and the dead ones restarted."""
        over_sample_rate = 0.0 if greedy else self.cfg.actor_rollout_ref.rollout.over_sample_rate
        trajs = self.run(rollout_with_timeout(self.agent_loop, prompts, self.cfg.trainer.rollout_timeout_s, greedy,
                                              seed, over_sample_rate))
        if heal:
            self.faults.heal()
        return trajs

    def collect(self, prompts: PromptBatch, step: int, draw: Draw | None, in_background: bool = False) -> Collected:
        """Step `step`'s rollout: `prompts` rolled out (and, under dynamic sampling, more batches from `draw` until
        enough groups carry a signal), the trajectories to train on, ReMax's greedy baselines. `in_background`: rolled out in
        a background thread while the previous step trains, which leaves restarting dead engines to the trainer's."""
        timer = Timer()
        with timer("rollout"):
            rolled, kept, filter_m = self._sample(prompts, step, draw, heal=not in_background)
        metrics = {**rollout_metrics(rolled), **self.agent_loop.instance_metrics(), **filter_m}
        collected = Collected(rolled, trainable(kept, self.row_multiple), metrics, in_background=in_background)
        if self.cfg.estimator.needs_greedy_rollout and collected.trains(self.cfg.trainer.max_failed_fraction):
            with timer("rollout_greedy"):
                greedy = self.rollout(prompts.prompts, greedy=True, heal=not in_background)
                totals = self.reward_fn.terms(greedy).totals(self.reward_fn.weights)  # (P,)
                collected.baselines = {t.prompt_uid: float(v) for t, v in zip(greedy, totals)}
        metrics.update(timer.metrics)
        return collected

    def _sample(self, prompts: PromptBatch, step: int, draw: Draw | None,
                heal: bool) -> tuple[list[Trajectory], list[Trajectory], dict[str, float]]:
        """(every trajectory rolled out, those of the kept groups, dynamic sampling's metrics)."""
        rolled = self.rollout(prompts.prompts, seed=self.seed(step), heal=heal)
        if not self.groups.enabled:
            return rolled, rolled, {}
        everything, batch, gens, dropped = list(rolled), rolled, 1, 0
        kept: list[list[Trajectory]] = []
        while True:
            for group in prompt_groups(batch):
                if self.groups.keeps(group):
                    kept.append(group)
                else:
                    dropped += 1
            if len(kept) >= self.groups.want or draw is None or self.groups.exhausted(gens):
                break
            logger.info("step %d: dynamic sampling kept %d of %d groups; rolling out prompt batch %d",
                        step, len(kept), self.groups.want, gens + 1)
            batch = self.rollout(draw().prompts, seed=self.seed(step, gens), heal=heal)
            everything += batch
            gens += 1
        if len(kept) < self.groups.want:
            raise self.groups.too_uniform(step, len(kept), gens)
        trajs = [t for group in kept[: self.groups.want] for t in group]
        return everything, trajs, self.groups.metrics(len(kept), dropped, gens)
