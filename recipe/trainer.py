"""The RL loop: one `Trainer.step` is rollout -> rewards -> log-probs -> advantages -> update -> sync -> log.

The trainer drives parts that live elsewhere and passes each only plain data: the agent loop
(`rollout`) returns trajectories, the one record that crosses the seam; `recipe.reward` scores
them and `recipe.batch.collate` pads them into tensors; Megatron worker
groups (`megatron_workers`, Ray actors) return log-probs / values and take PPO updates whose loss
functions come from `recipe.algos`; weights go back to every SGLang engine as HF-named tensors in
byte-size buckets (`megatron_workers.weights`), each engine's weight version is bumped and its
prefix cache flushed, so step k's rollout samples with the weights of step k-1's update.

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
- ReMax's baseline is a greedy rollout of each prompt through the same agent loop (tools and
  interactions included), rewarded like the samples; it is not trained on.
- `training/rollout_probs_diff_{mean,max,std}` (verl's names) watch the gap between the engine's
  and the actor's probabilities of each sampled token: |exp(old_log_prob) - exp(rollout_log_prob)|.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron_workers.weights import bucket_by_bytes
from megatron_workers.worker_group import MegatronWorkerGroup, concat_results
from recipe.algos import (
    AdvantageInputs,
    compute_advantage,
    apply_kl_penalty,
    make_kl_controller,
    place_token_rewards,
    policy_loss,
    value_loss,
)
from recipe.batch import collate
from recipe.config_schema import PPOConfig
from recipe.data.dataset import PromptBatch
from recipe.reward import RewardFn, RewardTerms, policy_text
from recipe.tracking import Tracking
from rollout.agent_loop import AgentLoop, RolloutPrompt, rollout_metrics
from rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


@dataclass
class Workers:
    """What the trainer drives: Megatron groups (ref / critic only when the algorithm needs them) and engines."""

    actor: MegatronWorkerGroup
    ref: MegatronWorkerGroup | None
    critic: MegatronWorkerGroup | None
    engines: list[Any]  # rollout.engines.sglang_engine.SGLangEngine (weight-sync receive side)


def trainable(trajs: list[Trajectory], multiple: int) -> list[Trajectory]:
    """Trajectories with at least one sampled token, cut to a multiple of `multiple` (in order)."""
    keep = [t for t in trajs if any(t.response_mask)]
    return keep[: len(keep) - len(keep) % multiple]


async def rollout_with_timeout(agent_loop: AgentLoop, prompts: list[RolloutPrompt], timeout_s: float | None,
                               greedy: bool = False) -> list[Trajectory]:
    """`agent_loop.generate(prompts)`, aborted after `timeout_s` seconds (None: no limit); returns what was produced."""
    task = asyncio.ensure_future(agent_loop.generate(prompts, greedy=greedy))
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
    """GRPO / PPO on Megatron workers and SGLang engines; `fit` runs `trainer.total_training_steps` steps."""

    def __init__(self, cfg: PPOConfig, workers: Workers, agent_loop: AgentLoop, tracker: Tracking):
        self.cfg = cfg
        self.workers = workers
        self.agent_loop = agent_loop
        self.tracker = tracker
        self.weight_version = 0  # the engines start from the checkpoint the actor was built from
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        self.reward_fn = RewardFn(cfg.reward, cfg.custom_reward_function)
        self.policy_loss_fn = partial(policy_loss, cfg=cfg.actor_rollout_ref.actor)
        self.value_loss_fn = partial(value_loss, cfg=cfg.critic)
        prompts = cfg.data.train_batch_size
        self.actor_mini_batches = prompts // cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        self.critic_mini_batches = prompts // cfg.critic.ppo_mini_batch_size if workers.critic else 1
        self.row_multiple = math.lcm(self.actor_mini_batches, self.critic_mini_batches) * cfg.dp_size
        self._loop = asyncio.new_event_loop()

    def fit(self, batches: Iterator[PromptBatch]) -> None:
        """Run the configured number of steps (step numbers start at 1)."""
        for step in range(1, self.cfg.trainer.total_training_steps + 1):
            self.step(next(batches), step)

    def step(self, prompts: PromptBatch, step: int) -> dict[str, float]:
        """One RL step; returns (and logs) its metrics."""
        timer, algo = Timer(), self.cfg.algorithm
        with timer("step"):
            with timer("rollout"):
                rolled = self._rollout(prompts.prompts)
            rollout_m = {**rollout_metrics(rolled), **self.agent_loop.instance_metrics()}
            trajs = trainable(rolled, self.row_multiple)
            if not trajs:
                logger.warning("step %d: no trajectory with a sampled token; skipping the update", step)
                self.tracker.log({**rollout_m, **timer.metrics}, step)
                return rollout_m
            batch = collate(trajs, self.agent_loop.pad_token_id)
            with timer("reward"):
                terms = self.reward_fn.terms(trajs)
                token_rewards = self.reward_fn.token_rewards(terms, batch["response_mask"])  # (B, T)
            if algo.adv_estimator == "remax":
                with timer("rollout_greedy"):
                    batch["reward_baselines"] = self._greedy_baselines(prompts.prompts, trajs)  # (B,)
            with timer("old_log_prob"):
                batch["old_log_probs"] = self._infer(self.workers.actor, "compute_log_prob", batch)["log_probs"]
            probs_diff = rollout_probs_diff(batch["old_log_probs"], batch["rollout_logprobs"], batch["response_mask"])
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
            with timer("update_actor"):
                actor_metrics = self.workers.actor.dispatch(
                    "update_policy", batch, mini_batches=self.actor_mini_batches, loss_fn=self.policy_loss_fn)[0]
            with timer("sync_weights"):
                self.sync_weights()
        metrics = {**rollout_m, **actor_metrics, **critic_metrics, **kl_metrics, **probs_diff, **timer.metrics,
                   **self._data_metrics(batch, token_rewards, terms, trajs, len(rolled) - len(trajs))}
        metrics["perf/tokens_per_s"] = float(batch["attention_mask"].sum()) / timer.metrics["timing/step_s"]
        metrics["perf/rollout_tokens_per_s"] = rollout_m["rollout/sampled_tokens"] / timer.metrics["timing/rollout_s"]
        self.tracker.log(metrics, step)
        self._log_examples(trajs, terms, step)
        return metrics

    # ---- pieces of a step ----------------------------------------------------------------

    def _rollout(self, prompts: list[RolloutPrompt], greedy: bool = False) -> list[Trajectory]:
        return self._loop.run_until_complete(
            rollout_with_timeout(self.agent_loop, prompts, self.cfg.trainer.rollout_timeout_s, greedy=greedy))

    def _greedy_baselines(self, prompts: list[RolloutPrompt], trajs: list[Trajectory]) -> torch.Tensor:
        """(B,) ReMax baselines: each sample's prompt rolled out greedily, its weighted total reward."""
        greedy = self._rollout(prompts, greedy=True)
        totals = self.reward_fn.terms(greedy).totals(self.cfg.reward)  # (P,)
        by_prompt = {t.prompt_uid: float(v) for t, v in zip(greedy, totals)}
        return torch.tensor([by_prompt[t.prompt_uid] for t in trajs], dtype=torch.float32)

    @staticmethod
    def _infer(group: MegatronWorkerGroup, method: str, batch: Batch) -> Batch:
        """A forward-only pass over the group (DP-split), results back in batch order."""
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids",
                                                           "responses", "response_mask")}
        return concat_results(group.dispatch(method, inputs))

    def sync_weights(self) -> None:
        """Actor weights -> every engine: HF-named tensors in byte-size buckets, a new version, cache flushed."""
        state = self.workers.actor.call_all("hf_state_dict")[0]  # global rank 0 holds the gathered HF state dict
        buckets = list(bucket_by_bytes(state.items(), self.cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20))
        self.weight_version += 1
        for engine in self.workers.engines:
            for i, bucket in enumerate(buckets):
                engine.update_weights_from_tensor(bucket, weight_version=self.weight_version,
                                                  flush_cache=i == len(buckets) - 1)
        logger.info("synced %d tensors in %d bucket(s) to %d engine(s): weight version %d",
                    len(state), len(buckets), len(self.workers.engines), self.weight_version)

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
        """Stop the worker groups, close the tools and the metrics sinks (the engines are the caller's)."""
        pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        if pending:  # interrupted mid-rollout: abort it, so tools are released and interactions finalized
            self._loop.run_until_complete(self.agent_loop.abort())
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self.agent_loop.tools.aclose())
        self._loop.close()
        for group in (self.workers.actor, self.workers.ref, self.workers.critic):
            if group is not None:
                group.shutdown()
        self.tracker.finish()
