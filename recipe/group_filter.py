"""Which rolled-out trajectories a step may train on, and dynamic sampling's group filter.

- A trajectory is trainable when it sampled at least one token and is not one of the over-sampled ones the agent loop
  cut short (`FinishReason.OVER_SAMPLED`); a step trains on a multiple of the batch split (mini-batches x DP ranks).
- Dynamic sampling (`algorithm.filter_groups`, DAPO's): a prompt group is kept only when its samples differ in the
  metric (`score`, `seq_reward` or the reward function's `acc`); a group whose samples all score the same carries no
  GRPO signal. Every schedule uses the same `GroupFilter`: the synchronous ones roll out more prompt batches until
  enough groups are kept, fully_async takes more finished groups from its stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.algos import FilterGroupsConfig
from recipe.engine_faults import RunFailed
from recipe.reward import RewardFn
from rollout.trajectory import FinishReason, Trajectory


def is_trainable(t: Trajectory) -> bool:
    """At least one sampled token, and not an over-sampled sample cut short."""
    return any(t.response_mask) and t.finish_reason is not FinishReason.OVER_SAMPLED


def trainable(trajs: list[Trajectory], multiple: int) -> list[Trajectory]:
    """The trainable trajectories, in order, cut to a multiple of `multiple`."""
    keep = [t for t in trajs if is_trainable(t)]
    return keep[: len(keep) - len(keep) % multiple]


def failed_fraction(trajs: list[Trajectory]) -> float:
    """The share of `trajs` that ended in error (`fault/failed_fraction`)."""
    return sum(t.finish_reason is FinishReason.ERROR for t in trajs) / max(len(trajs), 1)


def prompt_groups(trajs: list[Trajectory]) -> list[list[Trajectory]]:
    """The trainable samples of `trajs` by prompt (the GRPO groups), in order of first appearance."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        if is_trainable(t):
            groups.setdefault(t.prompt_uid, []).append(t)
    return list(groups.values())


@dataclass
class GroupFilter:
    """Dynamic sampling: which prompt groups carry a signal, and when to give up looking for more."""

    cfg: FilterGroupsConfig  # algorithm.filter_groups
    want: int  # data.train_batch_size: groups a step trains on
    reward_fn: RewardFn

    @property
    def enabled(self) -> bool:
        return self.cfg.enable

    def keeps(self, group: list[Trajectory]) -> bool:
        """Whether the group's trainable samples differ in `algorithm.filter_groups.metric` (always, when off)."""
        if not self.enabled:
            return True
        samples = [t for t in group if is_trainable(t)]
        return len(samples) > 1 and float(torch.tensor(self._metric(samples)).std()) > 0

    def exhausted(self, batches: float) -> bool:
        """Whether `batches` prompt batches reach `algorithm.filter_groups.max_num_gen_batches` (0: no limit)."""
        return 0 < self.cfg.max_num_gen_batches <= batches

    def too_uniform(self, step: int, kept: int, batches: float) -> RunFailed:
        """Dynamic sampling ran out of prompt batches before `want` groups were kept (verl stops the run there too)."""
        return RunFailed(f"step {step}: dynamic sampling kept {kept} of data.train_batch_size={self.want} groups "
                         f"with a {self.cfg.metric} spread in {batches:g} prompt batches "
                         f"(algorithm.filter_groups.max_num_gen_batches={self.cfg.max_num_gen_batches}): most prompts' "
                         "samples all score the same (data too hard or too easy for the policy); raise the limit (0: "
                         "none) or change the data")

    def metrics(self, kept: int, dropped: int, batches: float) -> dict[str, float]:
        return {"rollout/filter_groups/kept_groups": float(min(kept, self.want)),
                "rollout/filter_groups/dropped_groups": float(dropped),
                "rollout/filter_groups/gen_batches": float(batches)}

    def _metric(self, group: list[Trajectory]) -> list[float]:
        terms = self.reward_fn.terms(group)
        if self.cfg.metric == "score":
            return terms.outcome.tolist()
        if self.cfg.metric == "seq_reward":
            return terms.totals(self.reward_fn.weights).tolist()
        if "acc" not in terms.extra:
            raise RunFailed("algorithm.filter_groups.metric=acc but the reward function returns no 'acc' key; "
                            "use algorithm.filter_groups.metric=score (or return {'score': ..., 'acc': ...})")
        return terms.extra["acc"]
