"""The RL loop: one `Trainer.step` is rollout -> rewards -> log-probs -> advantages -> update -> sync -> log.

The trainer drives parts that live elsewhere and passes each only plain data: the agent loop
(`rollout`) returns trajectories, the one record that crosses the seam; `recipe.reward` scores
them and `recipe.batch.collate` pads them into tensors; Megatron worker
groups (`megatron_workers`, Ray actors) return log-probs / values and take PPO updates whose loss
functions come from `recipe.algos`; `recipe.weight_sync` streams the actor's weights into every
engine (Ray actors, `rollout.engines.engine_actor`) under a new version with the prefix cache
flushed, so step k's rollout samples with the weights of step k-1's update.

Colocated (hybrid placement), the engines and the Megatron ranks take turns on the same GPUs,
in this order every step: rollout -> engines release their memory -> Megatron state back on the
GPU (when `actor_rollout_ref.actor.megatron.*_offload`) -> train -> offload again -> engines
resume their weights -> sync -> engines resume their KV cache. On a Ray cluster without GPUs
there is no GPU memory to hand over (`Workers.colocated` is false there, see recipe.main_ppo);
tests/test_colocate.py checks the order with recorders around this same `step`.

Where it departs from verl's `RayPPOTrainer.fit`:
- Rewards are several kinds on the token axis (`recipe.algos.place_token_rewards`), each with a
  weight (`reward.*`): the outcome score and the tools' final `calc_reward` on the last sampled
  token, each tool call's step reward at the end of the assistant turn that made the call, each
  interaction score at the end of the assistant turn it graded.
- A trajectory with no sampled token (aborted or failed before its first token) cannot carry a
  reward or a loss: it is dropped, and so are a few more samples when needed for the batch to
  split evenly into mini-batches x DP ranks (`rollout/dropped_samples` counts both).
- The rollout runs on one persistent asyncio loop owned by the trainer (tools keep per-loop state).
  A rollout past `trainer.rollout_timeout_s`, or one still running when the trainer closes, is
  aborted (`AgentLoop.abort`); the step trains on what was sampled.
- Faults (README "Faults"): after every rollout each engine answers a one-token health probe;
  a dead engine (actor died, or probe past `rollout.engine_health_timeout_s`) is restarted on its
  bundle, synced to the current weight version with the checksum check, and only then routed to
  again; its trajectories were retried on live engines by the agent loop. An engine dying with no
  restart left (`rollout.max_engine_restarts`) aborts the rollout and stops the run (`RunFailed`).
  A step with more than `trainer.max_failed_fraction` of its trajectories in error, or none
  trainable, is not trained on; `trainer.max_failed_steps` such steps in a row stop the run.
  `fault/*` metrics count restarts, retries and skipped steps since the process started.
- Schedules (`async_training.schedule`): `sync` is the step above. `one_step_off` rolls out step k+1's prompts in
  a background thread (on the trainer's event loop) while step k computes log-probs and updates; the weight sync
  waits for that rollout, so each step trains on tokens sampled one weight version behind the actor (the first step
  excepted), and the engines never idle while Megatron trains. Every trained token is checked against the
  schedule's bound (`recipe.schedules`; a trajectory past it is dropped and counted), `rollout/staleness/*` and
  `perf/{engine,trainer}_busy_fraction` say how it went, and a checkpoint keeps the rollout done ahead, so a
  resumed run trains on what the uninterrupted one would have. `fully_async` streams prompt groups
  (`recipe.schedules.StreamingRollouter`, on the same event loop in a thread of its own): each step takes the first
  `data.train_batch_size` groups to finish that are within the staleness bound (and, under dynamic sampling, carry
  a signal), trains, and every `trigger_parameter_sync_step` steps syncs the weights with the generations in flight
  paused (`partial_rollout`) or finished first; its checkpoints keep the finished groups not yet trained and the
  prompts in flight, which a resumed run rolls out again first. The engines' busy fraction is the share of the step
  with a request in flight on some engine (`EngineRouter.busy_seconds`), in every schedule.
- ReMax's baseline is a greedy rollout of each prompt through the same agent loop (tools and
  interactions included), rewarded like the samples; it is not trained on.
- `trainer.critic_warmup` is verl's: the actor is updated from step `critic_warmup` on (verl's
  `critic_warmup <= global_steps`, steps counted from 1); before that a step updates the critic only, syncs
  no weights (the engines keep sampling with the unchanged ones) and logs `trainer/actor_updated` 0.
- `training/rollout_probs_diff_{mean,max,std}` (verl's names) watch the gap between the engine's
  and the actor's probabilities of each sampled token: |exp(old_log_prob) - exp(rollout_log_prob)|.
  With `algorithm.rollout_correction.*` set, the same two log-probs give each token an importance weight
  (`algos/rollout_correction.py`) that the policy loss applies, with `rollout_corr/*` metrics; this works in
  the synchronous schedule, where the gap is the engine's numerics against the trainer's.
"""
from __future__ import annotations

import asyncio
import logging
import math
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from megatron_workers.worker_group import MegatronWorkerGroup, concat_results
from recipe.algos import (
    AdvantageInputs,
    compute_advantage,
    apply_kl_penalty,
    make_kl_controller,
    place_token_rewards,
    policy_loss,
    rollout_weights,
    value_loss,
)
from recipe import checkpoint
from recipe.batch import collate
from recipe.config_schema import PPOConfig
from recipe.data.dataset import PromptBatch
from recipe.flops import MFU
from recipe.reward import RewardFn, RewardTerms, policy_text
from recipe.schedules import RolloutAhead, RolloutStopped, StreamingRollouter, staleness, within_staleness
from recipe.tracking import Tracking
from recipe.validation import TABLE_COLUMNS, Validator, trajectory_records, write_jsonl
from rollout.agent_loop import AgentLoop, RolloutPrompt, rollout_metrics
from rollout.engines.base import EngineDeadError
from rollout.trajectory import FinishReason, Trajectory

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


ROLLOUT_AHEAD = "rollout_ahead.pkl"  # in a one_step_off checkpoint: the next step's rollout (a pickled Collected)
ENGINE_MEMORY = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory tags; a release of None frees them all
STREAM = "stream.pkl"  # in a fully_async checkpoint: (finished groups not taken, prompts in flight or drawn)


@dataclass
class Collected:
    """One step's rollout, ready to train on."""

    rolled: list[Trajectory]  # everything rolled out (under dynamic sampling: every prompt batch)
    trajs: list[Trajectory]  # what the step trains on: trainable, in kept groups, a multiple of the batch split
    metrics: dict[str, float]  # rollout metrics and timings (timing/rollout_s, ...)
    ahead: bool = False  # rolled out in the background while the previous step trained (one_step_off, fully_async)
    baselines: dict[str, float] | None = None  # ReMax: prompt uid -> its greedy rollout's weighted total reward


class RunFailed(RuntimeError):
    """The run cannot go on (an engine died with no restart left, or too many steps in a row trained nothing);
    the message is one line naming what failed and the key that allows more."""


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


def move_megatron_state(groups: list[MegatronWorkerGroup], m: Any, method: str) -> None:
    """"offload" / "onload" on every group the Megatron state `m.*_offload` (a MegatronConfig) chooses. The
    workers are built offloaded (recipe.main_ppo: before the engines start and size their KV cache)."""
    if not (m.param_offload or m.grad_offload or m.optimizer_offload):
        return
    kwargs = {"params": m.param_offload, "grads": m.grad_offload, "optimizer": m.optimizer_offload} \
        if method == "offload" else {}
    for group in groups:
        group.call_all(method, **kwargs)


def trainable(trajs: list[Trajectory], multiple: int) -> list[Trajectory]:
    """Trajectories with at least one sampled token, over-sampled ones left out, cut to a multiple of `multiple`
    (in order)."""
    keep = [t for t in trajs if any(t.response_mask) and t.finish_reason is not FinishReason.OVER_SAMPLED]
    return keep[: len(keep) - len(keep) % multiple]


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


def rollout_probs_diff(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> dict[str, float]:
    """verl's `training/rollout_probs_diff_*`: |p_actor - p_engine| of each sampled token, all (B, T) inputs."""
    diff = (old_log_probs.exp() - rollout_log_probs.exp()).abs()[response_mask.bool()]  # (N,)
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_mean": float(diff.mean()), "training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0}


class Timer:
    """Wall time of named phases, as `timing/<name>_s` metrics."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.metrics[f"timing/{name}_s"] = time.monotonic() - t0


def _stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    values = x[mask.bool()] if mask is not None else x
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


class Trainer:
    """GRPO / PPO on Megatron workers and SGLang engines; `fit` runs `cfg.total_steps` steps, validating as configured."""

    def __init__(self, cfg: PPOConfig, workers: Workers, agent_loop: AgentLoop, tracker: Tracking, *,
                 validator: Validator | None = None, batches_per_epoch: int = 1, mfu: MFU | None = None):
        self.cfg = cfg
        self.workers = workers
        self.agent_loop = agent_loop
        self.tracker = tracker
        self.weight_version = 0  # the engines start from the checkpoint the actor was built from
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
        self.validator = validator  # data.val_files rolled out and scored (recipe.validation); None: no validation
        self.total_steps = cfg.total_steps(batches_per_epoch)
        self.mfu = mfu  # perf/mfu/actor (recipe.flops); None: the device's peak FLOPs are unknown (e.g. a CPU)
        self._loop = asyncio.new_event_loop()
        self.engine_restarts = [0] * len(agent_loop.router.engines)  # restarts so far, per engine
        self._engines_released: set[str] = set()  # colocated: the engines' memory tags released now (ENGINE_MEMORY)
        self.faults = {"fault/engine_restarts": 0.0, "fault/retried_trajectories": 0.0, "fault/skipped_steps": 0.0}
        self.failed_steps_in_row = 0  # steps in a row that trained nothing
        self._fatal: RunFailed | None = None  # an engine died with no restart left: raised once the rollout ends
        self._aborting: asyncio.Future | None = None
        self._ahead: Collected | None = None  # the next step's rollout, done (one_step_off; saved in checkpoints)
        self._stream: StreamingRollouter | None = None  # fully_async's rollouter, while `fit` runs
        self._stream_state: tuple | None = None  # fully_async: what a checkpoint saved of the rollouter (resume)
        self.unsynced_updates = 0  # actor updates not synced into the engines yet (fully_async syncs every few steps)
        self._step_start = (0.0, 0.0)  # the running step's start: wall time, the engines' busy seconds
        agent_loop.router.on_dead = self._engine_died

    def fit(self, batches: Iterator[PromptBatch]) -> None:
        """Run the configured number of steps (step numbers start at 1), from the step after `global_step` (set by
        `resume`); a checkpoint every `trainer.save_freq` steps and after the last one.

        `async_training.schedule=one_step_off`: while step k trains, a background thread rolls out step k+1's prompts
        on the engines (which still hold the weights before step k's update); the weight sync waits for that rollout,
        which step k+1 then trains on."""
        t, schedule = self.cfg.trainer, self.cfg.async_training.schedule
        if self.validator is not None and t.val_before_train:
            self.validate(self.global_step)

        def more() -> PromptBatch:
            return self._next_batch(batches)

        steps = tqdm(range(self.global_step + 1, self.total_steps + 1), desc="training", unit="step",
                     initial=self.global_step, total=self.total_steps, disable=None)  # None: off unless a tty
        if schedule == "fully_async":
            return self._fit_streaming(more, steps)
        ahead = RolloutAhead()
        try:
            for step in steps:
                self._start_step()
                collected, self._ahead = self._ahead or self._collect(more(), step, more), None
                if schedule == "one_step_off" and step < self.total_steps:
                    ahead.start(self._collect, more(), step + 1, more, ahead=True)
                try:
                    self._train(collected, step, before_sync=lambda: self._join(ahead) if ahead.pending else None)
                    if ahead.pending:  # a skipped step syncs nothing: join here
                        self._join(ahead)
                except BaseException:
                    ahead.abort(self.agent_loop, self._loop)
                    raise
                self._end_step(step)
        finally:
            ahead.close()

    def _fit_streaming(self, more: Callable[[], PromptBatch], steps: Iterator[int]) -> None:
        """fully_async: a streaming rollouter keeps the engines full while each step trains on the first groups to
        finish; the weights are synced every `trigger_parameter_sync_step` steps (and before a checkpoint)."""
        a, t = self.cfg.async_training, self.cfg.trainer
        capacity = math.ceil((1 + a.staleness_threshold) * a.trigger_parameter_sync_step * self.cfg.data.train_batch_size)
        stream = self._stream = StreamingRollouter(self.agent_loop, self._loop, lambda: more().prompts, capacity,
                                                   seed=self._rollout_seed(0))
        if self._stream_state is not None:
            finished, pending = self._stream_state
            stream.restore(finished, pending)
        stream.start()

        def before_sync() -> None:  # the engines idle, and the dead ones restarted
            if a.partial_rollout:
                stream.pause()
            else:
                stream.drain()
            self._heal_engines()
        try:
            for step in steps:
                self._start_step()
                collected = self._take_groups(stream, step)
                saves = t.save_freq > 0 and (step % t.save_freq == 0 or step == self.total_steps)
                sync = saves or step == self.total_steps or step % a.trigger_parameter_sync_step == 0
                self._train(collected, step, sync=sync, before_sync=before_sync, after_sync=stream.resume)
                self._end_step(step)
        finally:
            stream.stop()
            self._stream = None

    def _take_groups(self, stream: StreamingRollouter, step: int) -> Collected:
        """fully_async: the next `data.train_batch_size` finished groups within the staleness bound (past it: dropped,
        or rolled out again) and, under dynamic sampling, with a signal."""
        a, fg, want = self.cfg.async_training, self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        actor_version = self.weight_version + self.unsynced_updates
        rolled: list[Trajectory] = []
        kept: list[Trajectory] = []
        counts = {"stale": 0, "regenerated": 0, "filtered": 0, "taken": 0, "kept": 0}
        t0 = time.monotonic()
        while counts["kept"] < want:
            if fg.enable and 0 < fg.max_num_gen_batches and counts["taken"] >= fg.max_num_gen_batches * want:
                raise self._too_uniform(step, counts["kept"], fg.max_num_gen_batches)
            try:
                prompt, group = stream.take(self.cfg.trainer.rollout_timeout_s, check=self._raise_if_fatal)
            except (RolloutStopped, TimeoutError) as e:
                raise RunFailed(f"step {step}: {e}; stopping the run") from e
            counts["taken"] += 1
            rolled += group
            if any(staleness(x, actor_version) > a.bound for x in group):
                if a.stale_policy == "regenerate":
                    stream.requeue([prompt])
                    counts["regenerated"] += 1
                else:
                    counts["stale"] += 1
                continue
            trained = self._groups(group)
            if fg.enable and not (trained and self._has_signal(trained[0])):
                counts["filtered"] += 1
                continue
            kept += group
            counts["kept"] += 1
        self.faults["fault/retried_trajectories"] = float(self.agent_loop.retried)
        metrics = {**rollout_metrics(rolled), "timing/wait_groups_s": time.monotonic() - t0,
                   "rollout/staleness/dropped_groups": float(counts["stale"]),
                   "rollout/staleness/regenerated_groups": float(counts["regenerated"]),
                   "rollout/staleness/taken_mean": sum(staleness(x, actor_version) for x in rolled) / len(rolled)}
        if fg.enable:
            metrics.update({"rollout/filter_groups/kept_groups": float(counts["kept"]),
                            "rollout/filter_groups/dropped_groups": float(counts["filtered"]),
                            "rollout/filter_groups/gen_batches": counts["taken"] / want})
        metrics["fault/failed_fraction"] = sum(x.finish_reason is FinishReason.ERROR for x in rolled) / max(len(rolled), 1)
        return Collected(rolled, trainable(kept, self.row_multiple), metrics, ahead=True)

    def _start_step(self) -> None:
        self._step_start = (time.monotonic(), self.agent_loop.router.busy_seconds())

    def _end_step(self, step: int) -> None:
        """After step `step` trained (or was skipped): validation and checkpoint, as configured."""
        t = self.cfg.trainer
        self.global_step = step
        if self.validator is not None and t.test_freq > 0 and (step % t.test_freq == 0 or step == self.total_steps):
            self.validate(step)
        if t.save_freq > 0 and (step % t.save_freq == 0 or step == self.total_steps):
            self.save_checkpoint()

    def _join(self, ahead: RolloutAhead) -> Collected:
        """Wait for the rollout ahead (one_step_off), then probe the engines and restart the dead ones (which the
        background rollout leaves to this thread: a restart syncs weights from the actor)."""
        self._ahead = ahead.join()
        self._heal_engines()
        return self._ahead

    def validate(self, step: int) -> dict[str, float]:
        """Roll out and score the validation prompts (nothing trains on them); log their metrics at `step`, a
        `val/generations` table (`trainer.log_val_generations` rows) and `<validation_data_dir>/<step>.jsonl`."""
        timer = Timer()
        with timer("validation"):
            result = self._run(self.validator.run(step))
        self._raise_if_fatal()
        metrics = {**result.metrics, **timer.metrics}
        self.tracker.log(metrics, step)
        if result.table:
            self.tracker.log_table("val/generations", TABLE_COLUMNS, result.table, step)
        if self.cfg.trainer.validation_data_dir:
            write_jsonl(self.cfg.trainer.validation_data_dir, step, result.records)
        return metrics

    # ---- checkpoint and resume (recipe.checkpoint) ---------------------------------------

    def _next_batch(self, batches: Iterator[PromptBatch]) -> PromptBatch:
        prompts = next(batches)
        self.batches_consumed, self.epoch = self.batches_consumed + 1, prompts.epoch
        return prompts

    def save_checkpoint(self) -> Path:
        """Checkpoint the finished step `global_step`: the actor's (and critic's) shards and the trainer state,
        written atomically under `trainer.default_local_dir`; returns its directory."""
        t = self.cfg.trainer
        stream, batches = None, (self.batches_consumed, self.epoch)
        if self._stream is not None:  # fully_async: read on the rollouter's loop, where it draws prompts
            stream, batches = self._stream.snapshot(lambda: (self.batches_consumed, self.epoch))
        state = checkpoint.TrainerState(step=self.global_step, weight_version=self.weight_version,
                                        kl_coef=float(self.kl_ctrl.value), batches_consumed=batches[0],
                                        epoch=batches[1], wandb_run_id=self.tracker.run_id)

        def write(directory: Path) -> None:
            for name, group in (("actor", self.workers.actor), ("critic", self.workers.critic)):
                if group is not None:
                    group.call_all("save_checkpoint", str(directory / name))
            if self._ahead is not None:  # one_step_off: the next step's rollout, done, and its prompts drawn
                (directory / ROLLOUT_AHEAD).write_bytes(pickle.dumps(self._ahead))
            if stream is not None:
                (directory / STREAM).write_bytes(pickle.dumps(stream))
            state.write(directory)

        return checkpoint.save(t.default_local_dir, self.global_step, write, t.max_actor_ckpt_to_keep)

    def resume(self, directory: str | Path, batches: Iterator[PromptBatch]) -> None:
        """Continue from checkpoint `directory`: restore the actor (and critic) shards and the trainer state (with a
        one_step_off checkpoint, the next step's rollout), draw the prompt batches already consumed from `batches`,
        and sync the engines from the restored actor under the saved weight version, before any rollout."""
        directory = Path(directory)
        state = checkpoint.TrainerState.read(directory)
        for name, group in (("actor", self.workers.actor), ("critic", self.workers.critic)):
            if group is not None:
                if not (directory / name).is_dir():
                    raise FileNotFoundError(f"{directory} holds no {name} checkpoint, but this run has a {name}; resume "
                                            "with the algorithm the checkpoint was trained with")
                group.call_all("load_checkpoint", str(directory / name))
        self.global_step, self.kl_ctrl.value = state.step, state.kl_coef
        if (directory / ROLLOUT_AHEAD).is_file():  # the next step trains on it, as the uninterrupted run did
            self._ahead = pickle.loads((directory / ROLLOUT_AHEAD).read_bytes())
        if (directory / STREAM).is_file():  # fully_async: trained first, and rolled out again first
            self._stream_state = pickle.loads((directory / STREAM).read_bytes())
        for _ in range(state.batches_consumed):
            self._next_batch(batches)
        if self.epoch != state.epoch:
            raise ValueError(f"{directory}: after {state.batches_consumed} prompt batches the sampler is in epoch "
                             f"{self.epoch}, the checkpoint says {state.epoch}; resume with the same data.train_files, "
                             "data.train_batch_size, data.shuffle and trainer.seed")
        self.sync_weights(state.weight_version)
        logger.info("resumed from %s: step %d, weight version %d", directory, self.global_step, self.weight_version)

    def step(self, prompts: PromptBatch, step: int, more: Callable[[], PromptBatch] | None = None) -> dict[str, float]:
        """One synchronous RL step; returns (and logs) its metrics. `more` draws the next prompt batch (dynamic
        sampling)."""
        self._start_step()
        return self._train(self._collect(prompts, step, more), step)

    def _collect(self, prompts: PromptBatch, step: int, more: Callable[[], PromptBatch] | None,
                 ahead: bool = False) -> Collected:
        """Step `step`'s rollout: `prompts` rolled out (and more batches under dynamic sampling), the trajectories to
        train on, ReMax's greedy baselines. `ahead` (one_step_off's rollout in its own thread while the previous step
        trains) leaves restarting dead engines to the trainer's thread (`_join`)."""
        heal = not ahead
        timer, algo = Timer(), self.cfg.algorithm
        over_sample_rate = self.cfg.actor_rollout_ref.rollout.over_sample_rate
        with timer("rollout"):
            rolled = self._rollout(prompts.prompts, seed=self._rollout_seed(step), over_sample_rate=over_sample_rate,
                                   heal=heal)
            kept, filter_m = rolled, {}
            if algo.filter_groups.enable:
                rolled, kept, filter_m = self._filter_groups(rolled, step, more, heal)
        metrics = {**rollout_metrics(rolled), **self.agent_loop.instance_metrics(), **filter_m}
        metrics["fault/failed_fraction"] = sum(t.finish_reason is FinishReason.ERROR for t in rolled) / max(len(rolled), 1)
        collected = Collected(rolled, trainable(kept, self.row_multiple), metrics, ahead=ahead)
        if self.cfg.estimator.needs_greedy_rollout and self._trains(collected):
            with timer("rollout_greedy"):
                collected.baselines = self._greedy_baselines(prompts.prompts, heal)
        metrics.update(timer.metrics)
        return collected

    def _trains(self, collected: Collected) -> bool:
        """Whether a step trains on this rollout: some trajectory to train on, and not too many failed."""
        return bool(collected.trajs) and \
            collected.metrics["fault/failed_fraction"] <= self.cfg.trainer.max_failed_fraction

    def _train(self, collected: Collected, step: int, sync: bool = True, before_sync: Callable[[], Any] | None = None,
                after_sync: Callable[[], Any] | None = None) -> dict[str, float]:
        """The rest of step `step` on its rollout: rewards, log-probs, advantages, updates, weight sync (`sync`;
        `before_sync` waits for the rollout in flight to let it, `after_sync` lets it go on), metrics; returns (and
        logs) them."""
        timer, algo = Timer(), self.cfg.algorithm
        t0, busy0 = self._step_start
        rolled, rollout_m = collected.rolled, collected.metrics
        trajs, stale_m = within_staleness(collected.trajs, self.weight_version + self.unsynced_updates,
                                          self.cfg.async_training.bound, self.row_multiple)
        if not trajs or not self._trains(collected):
            return self._skip_step(step, rolled, {**rollout_m, **stale_m, "timing/step_s": time.monotonic() - t0})
        self.failed_steps_in_row = 0
        batch = collate(trajs, self.agent_loop.pad_token_id)
        with timer("reward"):
            terms = self.reward_fn.terms(trajs)
            token_rewards = self.reward_fn.token_rewards(terms, batch["response_mask"])  # (B, T)
        if collected.baselines is not None:
            batch["reward_baselines"] = torch.tensor([collected.baselines[t.prompt_uid] for t in trajs])  # (B,)
        self._engines_memory("release_memory_occupation")  # colocated: the rollout is done, engines free the GPUs
        self._megatron_memory("onload")
        with timer("old_log_prob"):
            batch["old_log_probs"] = self._infer(self.workers.actor, "compute_log_prob", batch)["log_probs"]
        probs_diff = rollout_probs_diff(batch["old_log_probs"], batch["rollout_logprobs"], batch["response_mask"])
        if algo.rollout_correction.enabled:
            batch["rollout_is_weights"], correction_m = rollout_weights(
                batch["old_log_probs"], batch["rollout_logprobs"], batch["response_mask"], algo.rollout_correction)
            probs_diff.update(correction_m)
        if self.workers.ref is not None:
            with timer("ref"):
                batch["ref_log_probs"] = self._infer(self.workers.ref, "compute_log_prob", batch)["log_probs"]
        if self.workers.critic is not None:
            with timer("values"):
                batch["values"] = self._infer(self.workers.critic, "compute_values", batch)["values"]
        kl_metrics = {}
        if algo.use_kl_in_reward:
            token_rewards, kl_metrics = apply_kl_penalty(token_rewards, batch["old_log_probs"], batch["ref_log_probs"],
                                                         batch["response_mask"], self.kl_ctrl, algo.kl_penalty)
        with timer("adv"):
            batch["advantages"], batch["returns"] = compute_advantage(AdvantageInputs(
                token_rewards, batch["response_mask"], index=[t.prompt_uid for t in trajs],
                values=batch.get("values"), reward_baselines=batch.get("reward_baselines")), algo)
        critic_metrics = {}
        if self.workers.critic is not None:
            with timer("update_critic"):
                critic_batch = {**batch, "old_values": batch["values"]}
                critic_metrics = self.workers.critic.dispatch(
                    "update_critic", critic_batch, mini_batches=self.critic_mini_batches, loss_fn=self.value_loss_fn)[0]
        actor_metrics, sync_metrics = {}, {}
        update_actor = self.cfg.trainer.critic_warmup <= step  # verl's warm-up: before it, the critic only
        if update_actor:
            with timer("update_actor"):
                actor_metrics = self.workers.actor.dispatch(
                    "update_policy", batch, mini_batches=self.actor_mini_batches, loss_fn=self.policy_loss_fn)[0]
            self.unsynced_updates += 1
        self._megatron_memory("offload")
        self._engines_memory("resume_memory_occupation", tags=["weights"])
        # unchanged weights are not synced again, unless colocated engines released theirs (SGLang keeps no copy)
        if sync and (self.unsynced_updates or self.workers.colocated):
            if before_sync is not None:  # the engines take new weights once the rollout in flight lets them
                with timer("wait_rollout"):
                    before_sync()
            with timer("sync_weights"):
                sync_metrics = self.sync_weights()
            if after_sync is not None:
                after_sync()
        self._engines_memory("resume_memory_occupation", tags=["kv_cache", "cuda_graph"])
        step_s = timer.metrics["timing/step_s"] = time.monotonic() - t0
        engines_busy_s = self.agent_loop.router.busy_seconds() - busy0
        # the trainer idle meanwhile: its own rollout (sync), or waiting for the one in flight / for finished groups
        waited_s = (0.0 if collected.ahead else rollout_m["timing/rollout_s"]) + \
            timer.metrics.get("timing/wait_rollout_s", 0.0) + rollout_m.get("timing/wait_groups_s", 0.0)
        metrics = {**rollout_m, **actor_metrics, **critic_metrics, **kl_metrics, **probs_diff, **sync_metrics,
                   **timer.metrics, **self.faults, **stale_m, "trainer/actor_updated": float(update_actor),
                   "perf/engine_busy_fraction": min(engines_busy_s / step_s, 1.0),
                   "perf/trainer_busy_fraction": 1.0 - min(waited_s / step_s, 1.0),
                   **self._data_metrics(batch, token_rewards, terms, trajs, len(rolled) - len(trajs))}
        metrics["perf/tokens_per_s"] = float(batch["attention_mask"].sum()) / step_s
        metrics["perf/time_per_step"] = step_s
        gpus = self.cfg.trainer.n_gpus_per_node * self.cfg.trainer.nnodes
        metrics["perf/throughput"] = metrics["perf/tokens_per_s"] / gpus  # verl's: tokens per second per GPU
        if self.mfu is not None and update_actor:
            metrics["perf/mfu/actor"] = self.mfu.of_update(batch["attention_mask"].sum(dim=1).tolist(),
                                                           self.cfg.actor_rollout_ref.actor.ppo_epochs,
                                                           timer.metrics["timing/update_actor_s"])
        if "timing/rollout_s" in rollout_m:  # a rollout of its own (not fully_async's stream)
            metrics["perf/rollout_tokens_per_s"] = rollout_m["rollout/sampled_tokens"] / rollout_m["timing/rollout_s"]
        self.tracker.log(metrics, step)
        self._log_examples(trajs, terms, step)
        if self.cfg.trainer.rollout_data_dir:
            totals = [float(r) for r in terms.totals(self.cfg.reward)]
            write_jsonl(self.cfg.trainer.rollout_data_dir, step,
                        trajectory_records(trajs, terms, totals, step, self.agent_loop.codec.tokenizer))
        return metrics

    # ---- pieces of a step ----------------------------------------------------------------

    def _rollout(self, prompts: list[RolloutPrompt], greedy: bool = False, seed: int | None = None,
                 over_sample_rate: float = 0.0, heal: bool = True) -> list[Trajectory]:
        """The agent loop's rollout of `prompts`, then (`heal`) every engine probed and the dead ones restarted."""
        trajs = self._run(rollout_with_timeout(
            self.agent_loop, prompts, self.cfg.trainer.rollout_timeout_s, greedy, seed, over_sample_rate))
        self.faults["fault/retried_trajectories"] = float(self.agent_loop.retried)
        if heal:
            self._heal_engines()
        return trajs

    # ---- faults ------------------------------------------------------------------------

    def _engine_died(self, idx: int, error: EngineDeadError) -> None:
        """The router's `on_dead` (in the rollout's event loop): with no restart left, abort the rollout now."""
        allowed = self.cfg.actor_rollout_ref.rollout.max_engine_restarts
        if self.engine_restarts[idx] < allowed or self._fatal is not None:
            return
        used = f"all {allowed} restarts used" if allowed else "restarts are off"
        self._fatal = RunFailed(f"{error}; {used} (actor_rollout_ref.rollout.max_engine_restarts={allowed}): "
                                "stopping the run")
        self._aborting = asyncio.ensure_future(self.agent_loop.abort())

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _heal_engines(self, version: int | None = None) -> dict[str, float] | None:
        """Probe every engine; restart each dead one on its bundle, then sync the engines to `version` (default:
        the current weight version) with the checksum check before the router uses it again (RunFailed when it has
        no restart left); the sync's metrics (None when every engine was alive)."""
        router, r = self.agent_loop.router, self.cfg.actor_rollout_ref.rollout
        self._raise_if_fatal()
        self._run(router.probe(r.engine_health_timeout_s))
        self._raise_if_fatal()
        dead = sorted(router.dead)
        if not dead:
            return None
        engines = [router.engines[i] for i in dead]
        for idx, engine in zip(dead, engines):
            self.engine_restarts[idx] += 1
            self.faults["fault/engine_restarts"] += 1
            logger.warning("%s; restarting it (restart %d of actor_rollout_ref.rollout.max_engine_restarts=%d)",
                           router.dead[idx], self.engine_restarts[idx], r.max_engine_restarts)
            try:
                engine.restart()
                # colocated, mid-step: the fresh engine holds what the others released, all but the weights the sync
                # below loads (SGLang refuses to resume memory it never released, killing the engine)
                released = sorted(self._engines_released - {"weights"})
                if self.workers.colocated and released:
                    engine.release_memory_occupation(released)
            except Exception as e:
                raise RunFailed(f"engine {engine.name}: restart failed: {type(e).__name__}: {e}") from e
        version = self.weight_version if version is None else version
        self.workers.weight_sync.forget_groups(engines)
        metrics = self.workers.weight_sync.sync(version, check=True)
        for idx, engine in zip(dead, engines):
            router.revive(idx)
            logger.warning("engine %s restarted, synced to weight version %d and checked", engine.name, version)
        return metrics

    def _skip_step(self, step: int, rolled: list[Trajectory], metrics: dict[str, float]) -> dict[str, float]:
        """Log a step that trains nothing; RunFailed when it is the trainer.max_failed_steps-th in a row."""
        t = self.cfg.trainer
        self.failed_steps_in_row += 1
        self.faults["fault/skipped_steps"] += 1
        failed = metrics["fault/failed_fraction"]
        reason = (f"{failed:.0%} of its trajectories ended in error (more than trainer.max_failed_fraction="
                  f"{t.max_failed_fraction})" if failed > t.max_failed_fraction else
                  "no trajectory to train on (none with a sampled token, or all past the staleness bound)")
        errors = [x.error for x in rolled if x.finish_reason is FinishReason.ERROR and x.error]
        logger.warning("step %d: %s; not training on it (%d such step(s) in a row of trainer.max_failed_steps=%d)%s",
                       step, reason, self.failed_steps_in_row, t.max_failed_steps,
                       f"; first error: {errors[0]}" if errors else "")
        metrics = {**metrics, **self.faults}
        self.tracker.log(metrics, step)
        if self.failed_steps_in_row >= t.max_failed_steps:
            raise RunFailed(f"{self.failed_steps_in_row} steps in a row trained nothing (step {step}: {reason}"
                            f"{'; first error: ' + errors[0] if errors else ''}); stopping the run "
                            f"(trainer.max_failed_steps={t.max_failed_steps})")
        return metrics

    def _rollout_seed(self, step: int, gen: int = 0) -> int | None:
        """The agent loop's seed for prompt batch `gen` of step `step` (a function of trainer.seed, the step and the
        batch only, so a resumed run samples what the uninterrupted one did); None unless rollout.deterministic."""
        if not self.cfg.actor_rollout_ref.rollout.deterministic:
            return None
        return self.cfg.trainer.seed * 1_000_003 + step + gen * 7_777_777

    def _filter_groups(self, rolled: list[Trajectory], step: int, more: Callable[[], PromptBatch] | None,
                       heal: bool = True) -> tuple[list[Trajectory], list[Trajectory], dict[str, float]]:
        """Dynamic sampling (`algorithm.filter_groups`): keep the groups whose samples differ in the metric, rolling
        out further prompt batches (from `more`) until `data.train_batch_size` groups are kept or
        `max_num_gen_batches` batches were rolled out. Returns (every trajectory rolled out, those of the first
        `train_batch_size` kept groups, metrics); RunFailed when the limit is reached first."""
        fg, want = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        everything, batch, gens = list(rolled), rolled, 1
        kept: list[list[Trajectory]] = []
        dropped = 0
        while True:
            for group in self._groups(batch):
                if self._has_signal(group):
                    kept.append(group)
                else:
                    dropped += 1
            if len(kept) >= want or more is None or 0 < fg.max_num_gen_batches <= gens:
                break
            logger.info("step %d: dynamic sampling kept %d of %d groups; rolling out prompt batch %d",
                        step, len(kept), want, gens + 1)
            batch = self._rollout(more().prompts, seed=self._rollout_seed(step, gens),
                                  over_sample_rate=self.cfg.actor_rollout_ref.rollout.over_sample_rate, heal=heal)
            everything += batch
            gens += 1
        if len(kept) < want:
            raise self._too_uniform(step, len(kept), gens)
        metrics = {"rollout/filter_groups/kept_groups": float(min(len(kept), want)),
                   "rollout/filter_groups/dropped_groups": float(dropped), "rollout/filter_groups/gen_batches": float(gens)}
        return everything, [t for group in kept[:want] for t in group], metrics

    @staticmethod
    def _groups(trajs: list[Trajectory]) -> list[list[Trajectory]]:
        """The trainable samples of `trajs` by prompt (the GRPO groups), in order of first appearance."""
        groups: dict[str, list[Trajectory]] = {}
        for t in trajs:
            if any(t.response_mask) and t.finish_reason is not FinishReason.OVER_SAMPLED:
                groups.setdefault(t.prompt_uid, []).append(t)
        return list(groups.values())

    def _too_uniform(self, step: int, kept: int, gens: int) -> RunFailed:
        """Dynamic sampling ran out of prompt batches (verl stops the run there too)."""
        fg = self.cfg.algorithm.filter_groups
        return RunFailed(f"step {step}: dynamic sampling kept {kept} of data.train_batch_size="
                         f"{self.cfg.data.train_batch_size} groups with a {fg.metric} spread in {gens} prompt batches "
                         f"(algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}): most prompts' samples "
                         "all score the same (data too hard or too easy for the policy); raise the limit (0: none) or "
                         "change the data")

    def _has_signal(self, group: list[Trajectory]) -> bool:
        """Dynamic sampling: whether the group's samples differ in `algorithm.filter_groups.metric`."""
        return len(group) > 1 and float(torch.tensor(self._group_metric(  # NaN (one sample): no
            group, self.cfg.algorithm.filter_groups.metric)).std()) > 0

    def _group_metric(self, group: list[Trajectory], metric: str) -> list[float]:
        """Each sample's `algorithm.filter_groups.metric`."""
        terms = self.reward_fn.terms(group)
        if metric == "score":
            return terms.outcome.tolist()
        if metric == "seq_reward":
            return terms.totals(self.cfg.reward).tolist()
        if "acc" not in terms.extra:
            raise RunFailed("algorithm.filter_groups.metric=acc but the reward function returns no 'acc' key; "
                            "use algorithm.filter_groups.metric=score (or return {'score': ..., 'acc': ...})")
        return terms.extra["acc"]

    def _greedy_baselines(self, prompts: list[RolloutPrompt], heal: bool) -> dict[str, float]:
        """ReMax baselines: each prompt rolled out greedily, its weighted total reward, by prompt uid."""
        greedy = self._rollout(prompts, greedy=True, heal=heal)
        totals = self.reward_fn.terms(greedy).totals(self.cfg.reward)  # (P,)
        return {t.prompt_uid: float(v) for t, v in zip(greedy, totals)}

    @staticmethod
    def _infer(group: MegatronWorkerGroup, method: str, batch: Batch) -> Batch:
        """A forward-only pass over the group (DP-split), results back in batch order."""
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids",
                                                           "responses", "response_mask")}
        return concat_results(group.dispatch(method, inputs))

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Actor weights -> every engine (recipe.weight_sync) under `version` (default: the version that counts the
        actor's updates); its metrics. A sync that fails because an engine died restarts it and syncs every engine
        again, checked (`_heal_engines`); any other failure is raised."""
        version = self.weight_version + self.unsynced_updates if version is None else version
        try:
            metrics = self.workers.weight_sync.sync(version)
        except Exception as e:
            metrics = self._heal_engines(version)  # probes first: None when every engine is alive
            if metrics is None:
                raise
            logger.warning("the weight sync to version %d had failed with an engine dead (%s: %s); synced again",
                           version, type(e).__name__, (str(e).splitlines() or [""])[0])
        self.weight_version, self.unsynced_updates = version, 0
        return metrics

    def _run(self, coro: Any) -> Any:
        """Run `coro` on the trainer's event loop: here, or on the rollouter's thread while fully_async runs it."""
        if self._loop.is_running():
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        return self._loop.run_until_complete(coro)

    def _engines_memory(self, method: str, tags: list[str] | None = None) -> None:
        """Colocated only: every engine releases / resumes the GPU memory of `tags` (None: all of it)."""
        if self.workers.colocated:
            for engine in self.workers.engines:
                getattr(engine, method)(tags)
            changed = set(tags or ENGINE_MEMORY)
            if method == "release_memory_occupation":
                self._engines_released |= changed
            else:
                self._engines_released -= changed

    def _megatron_memory(self, method: str) -> None:
        move_megatron_state(self.workers.groups(), self.cfg.actor_rollout_ref.actor.megatron, method)

    def _data_metrics(self, batch: Batch, token_rewards: torch.Tensor, terms: RewardTerms, trajs: list[Trajectory],
                      dropped: int) -> dict[str, float]:
        mask = batch["response_mask"]
        m = {"rollout/dropped_samples": float(dropped), "trainer/weight_version": float(self.weight_version),
             "rollout/weight_version_min": float(min(
                 (min(t.weight_versions) for t in trajs if t.weight_versions), default=-1))}
        m.update(_stats("critic/score", terms.outcome))
        m.update(_stats("reward/tool_final", terms.tool_final))
        m.update(_stats("critic/rewards", token_rewards.sum(dim=1)))
        m.update(_stats("critic/advantages", batch["advantages"], mask))
        m.update(_stats("critic/returns", batch["returns"], mask))
        for key in ("values", "reward_baselines"):
            if key in batch:
                m.update(_stats(f"critic/{key}", batch[key], mask if key == "values" else None))
        m.update(terms.metrics())
        m["response_length/sampled_mean"] = float(mask.sum(dim=1).float().mean())
        return m

    def _log_examples(self, trajs: list[Trajectory], terms: RewardTerms, step: int, k: int = 4) -> None:
        rows = [[t.uid, t.data_source, t.finish_reason.value if t.finish_reason else None, float(terms.outcome[i]),
                 policy_text(t.messages)[-500:]] for i, t in enumerate(trajs[:k])]
        self.tracker.log_table("rollout/examples", ["uid", "data_source", "finish_reason", "score", "response_tail"],
                               rows, step)

    def close(self) -> None:
        """Stop the weight sync, the worker groups and the engines, free the placement groups, close the
        tools and the metrics sinks."""
        pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        if pending:  # interrupted mid-rollout: abort it, so tools are released and interactions finalized
            self._loop.run_until_complete(self.agent_loop.abort())
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self.agent_loop.tools.aclose())
        self._loop.close()
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
