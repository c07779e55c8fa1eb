"""The RL loop: `Trainer.step` is one step, rollout -> rewards -> log-probs -> advantages -> updates -> sync -> log.

The trainer drives parts that live elsewhere and passes each only plain data: the schedule (`recipe.schedules`:
sync, one_step_off, fully_async) feeds each step its trajectories, the one record that crosses from `rollout`;
`recipe.reward` scores them and `recipe.batch.collate` pads them into tensors; Megatron worker groups
(`megatron_workers`, Ray actors) return log-probs / values and take PPO updates whose loss functions come from
`recipe.algos`; `recipe.weight_sync` streams the actor's weights into every engine under a new version with the
prefix cache flushed, so step k's rollout samples with the weights of step k-1's update. Around the step:
`recipe.colocation` hands the GPUs between engines and Megatron, `recipe.engine_faults` restarts dead engines and
skips steps that failed, `recipe.step_metrics` names what is logged, `recipe.checkpoint` saves and resumes.

Where it departs from verl's `RayPPOTrainer.fit`:
- Rewards are several kinds on the token axis (`recipe.algos.place_token_rewards`), each with a weight
  (`reward.*`): the outcome score and the tools' final `calc_reward` on the last sampled token, each tool call's
  step reward at the end of the assistant turn that made the call, each interaction score at the end of the
  assistant turn it graded.
- A trajectory with no sampled token (aborted or failed before its first token) cannot carry a reward or a loss: it
  is dropped, and so are a few more samples when needed for the batch to split evenly into mini-batches x DP ranks
  (`rollout/dropped_samples` counts both).
- `trainer.critic_warmup` is verl's: the actor is updated from step `critic_warmup` on (verl's
  `critic_warmup <= global_steps`, steps counted from 1); before that a step updates the critic only, syncs no
  weights unless colocated engines released theirs, and logs `trainer/actor_updated` 0.
- `training/rollout_probs_diff_{mean,max,std}` (verl's names) watch the gap between the engine's and the actor's
  probabilities of each sampled token; with `algorithm.rollout_correction.*` set, the same two log-probs give each
  token an importance weight (`algos/rollout_correction.py`) that the policy loss applies (`rollout_corr/*`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from megatron_workers.worker_group import MegatronWorkerGroup, concat_results
from recipe import checkpoint
from recipe.algos import (AdvantageInputs, apply_kl_penalty, compute_advantage, make_kl_controller, policy_loss,
                          rollout_weights, value_loss)
from recipe.batch import collate
from recipe.colocation import GpuHandover
from recipe.config_schema import PPOConfig
from recipe.data.dataset import PromptBatch
from recipe.engine_faults import EngineFaults, RunFailed
from recipe.flops import MFU
from recipe.group_filter import GroupFilter
from recipe.reward import RewardFn, RewardTerms
from recipe.rollouter import run_on
from recipe.rollouts import Collected, Draw, Rollouts
from recipe.schedules import SCHEDULES, within_staleness
from recipe.step_metrics import (Batch, StepClock, Timer, data_metrics, example_rows, perf_metrics,
                                 rollout_probs_diff)
from recipe.tracking import Tracking
from recipe.validation import TABLE_COLUMNS, Validator, trajectory_records, write_jsonl
from rollout.agent_loop import AgentLoop
from rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)




@dataclass
class Workers:
    """What the trainer drives: Megatron groups (ref / critic only when the algorithm needs them) and engines."""

    actor: MegatronWorkerGroup
    ref: MegatronWorkerGroup | None
    critic: MegatronWorkerGroup | None
    engines: list[Any]  # rollout.engines.engine_actor.EngineClient: Ray actor handles, one SGLang engine each
    weight_sync: Any  # recipe.weight_sync.WeightSync: actor -> engines
    colocated: bool  # hybrid placement: engines and Megatron ranks share GPUs, so they take turns on them
    placement: Any = None  # recipe.placement.Placement holding everyone's bundles (removed by close)

    def groups(self) -> list[MegatronWorkerGroup]:
        return [g for g in (self.actor, self.ref, self.critic) if g is not None]


class Trainer:
    """GRPO / PPO on Megatron workers and SGLang engines; `fit` runs `cfg.total_steps` steps, validating as configured."""

    def __init__(self, cfg: PPOConfig, workers: Workers, agent_loop: AgentLoop, tracker: Tracking, *,
                 validator: Validator | None = None, batches_per_epoch: int = 1, mfu: MFU | None = None):
        self.cfg, self.workers, self.agent_loop, self.tracker = cfg, workers, agent_loop, tracker
        self.validator = validator  # data.val_files rolled out and scored (recipe.validation); None: no validation
        self.mfu = mfu  # perf/mfu/actor (recipe.flops); None: the device's peak FLOPs are unknown (e.g. a CPU)
        self.total_steps = cfg.total_steps(batches_per_epoch)
        self.weight_version = 0  # the engines' weights: they start from the checkpoint the actor was built from
        self.unsynced_updates = 0  # actor updates not synced into the engines yet (fully_async syncs every few steps)
        self.global_step = 0  # the last finished step (restored by `resume`)
        self.batches_consumed, self.epoch = 0, 0  # the prompt sampler's position (saved in checkpoints)
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        self.reward_fn = RewardFn(cfg.reward, cfg.custom_reward_function)
        self.policy_loss_fn = partial(policy_loss, cfg=cfg.actor_rollout_ref.actor)
        self.value_loss_fn = partial(value_loss, cfg=cfg.critic)
        prompts = cfg.data.train_batch_size
        self.actor_mini_batches = prompts // cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        self.critic_mini_batches = prompts // cfg.critic.ppo_mini_batch_size if workers.critic else 1
        self.row_multiple = cfg.batch_multiple  # every role's mini-batches split evenly over its DP ranks
        self.loop = asyncio.new_event_loop()  # the rollout's, for the whole run (tools keep per-loop state)
        self.handover = GpuHandover(workers.engines, workers.groups(), cfg.actor_rollout_ref.actor.megatron,
                                    workers.colocated)
        self.faults = EngineFaults(cfg, agent_loop, workers, self.handover, self.run, lambda: self.weight_version)
        self.rollouts = Rollouts(cfg, agent_loop, self.loop, self.faults, self.reward_fn,
                                 GroupFilter(cfg.algorithm.filter_groups, prompts, self.reward_fn), self.row_multiple)
        self.schedule = SCHEDULES[cfg.async_training.schedule](cfg, self.rollouts, self.total_steps,
                                                               lambda: self.actor_version)
        self.clock = StepClock(agent_loop.router.busy_seconds)

    @property
    def actor_version(self) -> int:
        """The actor's weight version: the engines' plus the updates not synced yet."""
        return self.weight_version + self.unsynced_updates

    def fit(self, batches: Iterator[PromptBatch]) -> None:
        """Run the configured number of steps (step numbers start at 1), from the step after `global_step` (set by
        `resume`): validation every `trainer.test_freq` steps, a checkpoint every `trainer.save_freq` steps and after
        the last one."""
        if self.validator is not None and self.cfg.trainer.val_before_train:
            self.validate(self.global_step)
        if self.cfg.trainer.val_only:  # verl's val_only: the validation above, no training
            return
        steps = tqdm(range(self.global_step + 1, self.total_steps + 1), desc="training", unit="step",
                     initial=self.global_step, total=self.total_steps, disable=None)  # None: off unless a tty
        try:
            for step in steps:
                self.step(step, partial(self._draw, batches))
                self._end_step(step)
        finally:
            self.schedule.close()

    def step(self, step: int, draw: Draw) -> dict[str, float]:
        """One RL step on what the schedule collects (drawing prompt batches from `draw`); returns (and logs) its
        metrics."""
        self.clock.start()
        collected = self.schedule.collect(step, draw)
        trajs, stale_m = within_staleness(collected.trajs, self.actor_version, self.cfg.async_training.bound,
                                          self.row_multiple)
        if not trajs or not collected.trains(self.cfg.trainer.max_failed_fraction):
            return self._skip(step, collected, stale_m)
        self.faults.step_trained()
        timer, batch = Timer(), collate(trajs, self.agent_loop.pad_token_id)
        with timer("reward"):
            terms, token_rewards = self._rewards(trajs, batch, collected.baselines)
        with self.handover.training():  # colocated: the engines free the GPUs while Megatron trains
            m = self._log_probs(batch, timer)
            with timer("adv"):
                token_rewards, kl_m = self._advantages(batch, token_rewards, trajs)
            m |= self._update(batch, step, timer)
        if self.schedule.syncs(step) and (self.unsynced_updates or self.workers.colocated):
            with timer("wait_rollout"):  # the engines take new weights once the rollout in flight lets them
                self.schedule.before_sync()
            with timer("sync_weights"):
                m |= self.sync_weights()
            self.schedule.after_sync()
        self.handover.resume_kv_cache()
        self.schedule.step_done()
        return self._log(step, collected, trajs, batch, terms, token_rewards, {**m, **kl_m, **stale_m, **timer.metrics})

    # ---- the step's parts ------------------------------------------------------------------

    def _rewards(self, trajs: list[Trajectory], batch: Batch,
                 baselines: dict[str, float] | None) -> tuple[RewardTerms, torch.Tensor]:
        """Every reward term, and their weighted sum on the token axis (B, T); ReMax's baselines into the batch."""
        terms = self.reward_fn.terms(trajs)
        if baselines is not None:
            batch["reward_baselines"] = torch.tensor([baselines[t.prompt_uid] for t in trajs])  # (B,)
        return terms, self.reward_fn.token_rewards(terms, batch["response_mask"])

    def _log_probs(self, batch: Batch, timer: Timer) -> dict[str, float]:
        """Old (and reference) log-probs, values, rollout-correction weights into the batch; their metrics."""
        with timer("old_log_prob"):
            batch["old_log_probs"] = _infer(self.workers.actor, "compute_log_prob", batch)["log_probs"]
        m = rollout_probs_diff(batch["old_log_probs"], batch["rollout_logprobs"], batch["response_mask"])
        if self.cfg.algorithm.rollout_correction.enabled:
            batch["rollout_is_weights"], correction_m = rollout_weights(
                batch["old_log_probs"], batch["rollout_logprobs"], batch["response_mask"],
                self.cfg.algorithm.rollout_correction)
            m.update(correction_m)
        if self.workers.ref is not None:
            with timer("ref"):
                batch["ref_log_probs"] = _infer(self.workers.ref, "compute_log_prob", batch)["log_probs"]
        if self.workers.critic is not None:
            with timer("values"):
                batch["values"] = _infer(self.workers.critic, "compute_values", batch)["values"]
        return m

    def _advantages(self, batch: Batch, token_rewards: torch.Tensor,
                    trajs: list[Trajectory]) -> tuple[torch.Tensor, dict[str, float]]:
        """KL in the reward (when on), then advantages and returns into the batch; the token rewards (B, T) they were
        computed from, and the KL metrics."""
        algo, m = self.cfg.algorithm, {}
        if algo.use_kl_in_reward:
            token_rewards, m = apply_kl_penalty(token_rewards, batch["old_log_probs"], batch["ref_log_probs"],
                                                batch["response_mask"], self.kl_ctrl, algo.kl_penalty)
        batch["advantages"], batch["returns"] = compute_advantage(AdvantageInputs(
            token_rewards, batch["response_mask"], index=[t.prompt_uid for t in trajs],
            values=batch.get("values"), reward_baselines=batch.get("reward_baselines")), algo)
        return token_rewards, m

    def _update(self, batch: Batch, step: int, timer: Timer) -> dict[str, float]:
        """The critic's update, then the actor's (from step `trainer.critic_warmup` on); their metrics."""
        m: dict[str, float] = {}
        if self.workers.critic is not None:
            with timer("update_critic"):
                m |= self.workers.critic.dispatch("update_critic", {**batch, "old_values": batch["values"]},
                                                  mini_batches=self.critic_mini_batches, loss_fn=self.value_loss_fn)[0]
        update_actor = self.cfg.trainer.critic_warmup <= step  # verl's warm-up: before it, the critic only
        if update_actor:
            with timer("update_actor"):
                m |= self.workers.actor.dispatch("update_policy", batch, mini_batches=self.actor_mini_batches,
                                                 loss_fn=self.policy_loss_fn)[0]
            self.unsynced_updates += 1
            if self.mfu is not None:
                m["perf/mfu/actor"] = self.mfu.of_update(batch["attention_mask"].sum(dim=1).tolist(),
                                                         self.cfg.actor_rollout_ref.actor.ppo_epochs,
                                                         timer.metrics["timing/update_actor_s"])
        return {**m, "trainer/actor_updated": float(update_actor)}

    def _log(self, step: int, collected: Collected, trajs: list[Trajectory], batch: Batch, terms: RewardTerms,
             token_rewards: torch.Tensor, m: dict[str, float]) -> dict[str, float]:
        """Log the step's metrics, its example table and (`trainer.rollout_data_dir`) its trajectories."""
        t, rollout_m = self.cfg.trainer, collected.metrics
        step_s = m["timing/step_s"] = self.clock.elapsed()
        # the trainer idle meanwhile: its own rollout (sync), or waiting for the one in flight / for finished groups
        waited_s = (0.0 if collected.in_background else rollout_m["timing/rollout_s"]) + \
            m.get("timing/wait_rollout_s", 0.0) + rollout_m.get("timing/wait_groups_s", 0.0)
        metrics = {**rollout_m, **m, **self.faults.metrics(), **self.clock.busy_fractions(step_s, waited_s),
                   **data_metrics(batch, token_rewards, terms, trajs, len(collected.rolled) - len(trajs),
                                  self.weight_version),
                   **perf_metrics(batch, step_s, rollout_m, t.n_gpus_per_node * t.nnodes)}
        self.tracker.log(metrics, step)
        self.tracker.log_table("rollout/examples", *example_rows(trajs, terms), step)
        if t.rollout_data_dir:
            totals = [float(r) for r in terms.totals(self.cfg.reward)]
            write_jsonl(t.rollout_data_dir, step,
                        trajectory_records(trajs, terms, totals, step, self.agent_loop.codec.tokenizer))
        return metrics

    def _skip(self, step: int, collected: Collected, stale_m: dict[str, float]) -> dict[str, float]:
        """Log a step that trains nothing; RunFailed when it is the trainer.max_failed_steps-th in a row."""
        stop = self.faults.skip_step(step, collected.rolled, collected.failed)
        metrics = {**collected.metrics, **stale_m, "timing/step_s": self.clock.elapsed(), **self.faults.metrics()}
        self.tracker.log(metrics, step)
        if stop is not None:
            raise stop  # `fit` closes the schedule: a rollout still running is aborted
        self.schedule.step_done()
        return metrics

    # ---- weights, validation, checkpoints -----------------------------------------------------

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Actor weights -> every engine (recipe.weight_sync) under `version` (default: the actor's); its metrics. A
        sync that fails because an engine died restarts it and syncs every engine again, checked
        (`EngineFaults.heal`); any other failure is raised."""
        version = self.actor_version if version is None else version
        try:
            metrics = self.workers.weight_sync.sync(version)
        except Exception as e:
            metrics = self.faults.heal(version)  # probes first: None when every engine is alive
            if metrics is None:
                raise
            logger.warning("the weight sync to version %d had failed with an engine dead (%s: %s); synced again",
                           version, type(e).__name__, (str(e).splitlines() or [""])[0])
        self.weight_version, self.unsynced_updates = version, 0
        return metrics

    def run(self, coro: Any) -> Any:
        """Run `coro` on the rollout's event loop (here, or on the rollouter's thread while fully_async runs it)."""
        return run_on(self.loop, coro)

    def validate(self, step: int) -> dict[str, float]:
        """Roll out and score the validation prompts (nothing trains on them); log their metrics at `step`, a
        `val/generations` table (`trainer.log_val_generations` rows) and `<validation_data_dir>/<step>.jsonl`."""
        timer = Timer()
        with timer("validation"):
            result = self.run(self.validator.run(step))
        self.faults.raise_if_fatal()
        metrics = {**result.metrics, **timer.metrics}
        self.tracker.log(metrics, step)
        if result.table:
            self.tracker.log_table("val/generations", TABLE_COLUMNS, result.table, step)
        if self.cfg.trainer.validation_data_dir:
            write_jsonl(self.cfg.trainer.validation_data_dir, step, result.records)
        return metrics

    def _end_step(self, step: int) -> None:
        """After step `step` trained (or was skipped): validation and checkpoint, as configured."""
        t = self.cfg.trainer
        self.global_step = step
        if self.validator is not None and t.test_freq > 0 and (step % t.test_freq == 0 or step == self.total_steps):
            self.validate(step)
        if t.save_freq > 0 and (step % t.save_freq == 0 or step == self.total_steps):
            self.save_checkpoint()

    def _draw(self, batches: Iterator[PromptBatch]) -> PromptBatch:
        """The next prompt batch, counted (the sampler's position is saved in checkpoints)."""
        prompts = next(batches)
        self.batches_consumed, self.epoch = self.batches_consumed + 1, prompts.epoch
        return prompts

    def save_checkpoint(self) -> Path:
        """Checkpoint the finished step `global_step`: the actor's (and critic's) shards, what the schedule keeps
        between steps, and the trainer state, written atomically under `trainer.default_local_dir`."""
        t = self.cfg.trainer
        files, (consumed, epoch) = self.schedule.snapshot(lambda: (self.batches_consumed, self.epoch))
        state = checkpoint.TrainerState(step=self.global_step, weight_version=self.weight_version,
                                        kl_coef=float(self.kl_ctrl.value), batches_consumed=consumed, epoch=epoch,
                                        wandb_run_id=self.tracker.run_id)
        return checkpoint.save_run(t.default_local_dir, state, self._checkpointed(), files, t.max_actor_ckpt_to_keep)

    def resume(self, directory: str | Path, batches: Iterator[PromptBatch]) -> None:
        """Continue from checkpoint `directory`: restore the actor (and critic) shards, the trainer state and what the
        schedule kept, draw the prompt batches already consumed from `batches`, and sync the engines from the restored
        actor under the saved weight version, before any rollout."""
        state, files = checkpoint.load_run(directory, self._checkpointed())
        self.global_step, self.kl_ctrl.value = state.step, state.kl_coef
        self.schedule.restore(files)
        for _ in range(state.batches_consumed):
            self._draw(batches)
        if self.epoch != state.epoch:
            raise ValueError(f"{directory}: after {state.batches_consumed} prompt batches the sampler is in epoch "
                             f"{self.epoch}, the checkpoint says {state.epoch}; resume with the same data.train_files, "
                             "data.train_batch_size, data.shuffle and trainer.seed")
        self.sync_weights(state.weight_version)
        logger.info("resumed from %s: step %d, weight version %d", directory, self.global_step, self.weight_version)

    def _checkpointed(self) -> dict[str, MegatronWorkerGroup]:
        return {name: g for name, g in (("actor", self.workers.actor), ("critic", self.workers.critic)) if g}

    def close(self) -> None:
        """Stop the schedule, the weight sync, the worker groups and the engines, free the placement groups, close the
        tools and the metrics sinks."""
        self.schedule.close()
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        if pending:  # interrupted mid-rollout: abort it, so tools are released and interactions finalized
            self.loop.run_until_complete(self.agent_loop.abort())
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.agent_loop.tools.aclose())
        self.loop.close()
        try:
            self.workers.weight_sync.close()
        except Exception as e:  # noqa: BLE001 - after a fault: a dead rank or engine has no group left to leave
            logger.warning("the weight sync's process groups were not torn down (%s: %s)", type(e).__name__,
                           (str(e).splitlines() or [""])[0])
        for group in self.workers.groups():
            group.shutdown()
        for engine in self.workers.engines:
            engine.shutdown()
        if self.workers.placement is not None:
            self.workers.placement.shutdown()
        self.tracker.finish()


def _infer(group: MegatronWorkerGroup, method: str, batch: Batch) -> Batch:
    """A forward-only pass over the group (DP-split), results back in batch order."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids", "responses",
                                                       "response_mask")}
    return concat_results(group.dispatch(method, inputs))
