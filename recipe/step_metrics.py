"""A training step's metrics: phase timings, reward / advantage statistics, perf figures and the example table.

verl's names where verl has the figure (`critic/score/mean`, `training/rollout_probs_diff_*`, `perf/throughput`,
`timing/*_s`); the rest say what they count. Nothing here changes what a step trains on.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from recipe.reward import RewardTerms, policy_text
from rollout.trajectory import Trajectory

Batch = dict[str, torch.Tensor]


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


class StepClock:
    """When the running step started, in wall time and in the engines' busy seconds (`EngineRouter.busy_seconds`)."""

    def __init__(self, busy_seconds: Any) -> None:
        self.busy_seconds = busy_seconds  # () -> float
        self.t0, self.busy0 = 0.0, 0.0

    def start(self) -> None:
        self.t0, self.busy0 = time.monotonic(), self.busy_seconds()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def busy_fractions(self, step_s: float, waited_s: float) -> dict[str, float]:
        """Shares of the step with a request in flight on some engine, and with the trainer not waiting for one."""
        return {"perf/engine_busy_fraction": min((self.busy_seconds() - self.busy0) / step_s, 1.0),
                "perf/trainer_busy_fraction": 1.0 - min(waited_s / step_s, 1.0)}


def stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """`<prefix>/{mean,max,min}` of `x` (where `mask`), nothing when empty."""
    values = x[mask.bool()] if mask is not None else x
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def rollout_probs_diff(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> dict[str, float]:
    """verl's `training/rollout_probs_diff_*`: |p_actor - p_engine| of each sampled token, all (B, T) inputs."""
    diff = (old_log_probs.exp() - rollout_log_probs.exp()).abs()[response_mask.bool()]  # (N,)
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_mean": float(diff.mean()), "training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0}


def data_metrics(batch: Batch, token_rewards: torch.Tensor, terms: RewardTerms, trajs: list[Trajectory],
                 dropped: int, weight_version: int) -> dict[str, float]:
    """Rewards, advantages, returns, values and lengths of what the step trained on."""
    mask = batch["response_mask"]  # (B, T)
    m = {"rollout/dropped_samples": float(dropped), "trainer/weight_version": float(weight_version),
         "rollout/weight_version_min": float(min(
             (min(t.weight_versions) for t in trajs if t.weight_versions), default=-1))}
    m.update(stats("critic/score", terms.outcome))
    m.update(stats("reward/tool_final", terms.tool_final))
    m.update(stats("critic/rewards", token_rewards.sum(dim=1)))
    m.update(stats("critic/advantages", batch["advantages"], mask))
    m.update(stats("critic/returns", batch["returns"], mask))
    for key in ("values", "reward_baselines"):
        if key in batch:
            m.update(stats(f"critic/{key}", batch[key], mask if key == "values" else None))
    m.update(terms.metrics())
    m["response_length/sampled_mean"] = float(mask.sum(dim=1).float().mean())
    return m


def perf_metrics(batch: Batch, step_s: float, rollout_m: dict[str, float], n_gpus: int) -> dict[str, float]:
    """Tokens per second (verl's `perf/throughput` is per GPU), the step's time, the rollout's own token rate."""
    tokens_per_s = float(batch["attention_mask"].sum()) / step_s
    m = {"perf/tokens_per_s": tokens_per_s, "perf/time_per_step": step_s, "perf/throughput": tokens_per_s / n_gpus}
    if "timing/rollout_s" in rollout_m:  # a rollout of its own (not fully_async's stream)
        m["perf/rollout_tokens_per_s"] = rollout_m["rollout/sampled_tokens"] / rollout_m["timing/rollout_s"]
    return m


def example_rows(trajs: list[Trajectory], terms: RewardTerms, k: int = 4) -> tuple[list[str], list[list[Any]]]:
    """The `rollout/examples` table: columns and the first `k` trajectories' rows."""
    rows = [[t.uid, t.data_source, t.finish_reason.value if t.finish_reason else None, float(terms.outcome[i]),
             policy_text(t.messages)[-500:]] for i, t in enumerate(trajs[:k])]
    return ["uid", "data_source", "finish_reason", "score", "response_tail"], rows
