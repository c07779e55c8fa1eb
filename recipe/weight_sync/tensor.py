"""The tensor path (colocated / hybrid placement): each bucket handed over by handle on the engine's own GPU.

The ranks `tensor_senders` names (`PlacementPlan.tensor_senders`: the rank on each engine TP rank's GPU) pickle
every bucket of their stage by handle (CUDA IPC on GPUs, a shared-memory name on CPU), one copy per engine TP rank
they serve, and hand it to the engine actor (`EngineActor.load_payload`); every stage ships at once, inside one
weight-update session per engine.
"""
from __future__ import annotations

import dataclasses

from megatron_workers.sync_plan import SyncPlan
from recipe.weight_sync.base import Sent, SyncPath, in_session


class TensorSync(SyncPath):
    """`serializers`: {global Megatron rank: ((engine index, engine TP rank), ...)}, the copies each rank makes."""

    def __init__(self, group, engines, *, tensor_senders: list[list[list[int]]] | None = None,
                 disk_dir: str | None = None) -> None:
        """`tensor_senders[i][r][s]`: the global Megatron rank that serializes pipeline stage s's weights for
        engine i's TP rank r; None: each stage's first rank (TP 0, DP 0) serializes every copy."""
        super().__init__(group, engines)
        self.serializers = serializers(group.ranks, [e.tp_size for e in engines], tensor_senders)

    def update(self, version: int, plan: SyncPlan) -> Sent:
        plan = dataclasses.replace(plan, transport="tensor", serializers=self.serializers)
        return in_session(self.engines, version, lambda: self.group.send_weights(plan))


def serializers(ranks, tp_sizes: list[int],
                tensor_senders: list[list[list[int]]] | None) -> dict[int, tuple[tuple[int, int], ...]]:
    """{global rank: ((engine index, engine TP rank), ...)} from `tensor_senders` (see `TensorSync.__init__`) and
    the group's `ranks` (`RankInfo`): each copy of each stage's weights is serialized by exactly one rank of that
    stage; raises ValueError when `tensor_senders` does not say so."""
    stage_of = {info.rank: info.pp_rank for info in ranks}
    stages = sorted(set(stage_of.values()))
    if tensor_senders is None:
        firsts = [min(i.rank for i in ranks if i.pp_rank == s and i.tp_rank == 0 and i.dp_rank == 0) for s in stages]
        tensor_senders = [[firsts for _ in range(tp)] for tp in tp_sizes]
    if len(tensor_senders) != len(tp_sizes):
        raise ValueError(f"tensor_senders has {len(tensor_senders)} entries for {len(tp_sizes)} engines")
    out: dict[int, list[tuple[int, int]]] = {}
    for i, (tp, per_rank) in enumerate(zip(tp_sizes, tensor_senders)):
        if len(per_rank) != tp:
            raise ValueError(f"tensor_senders[{i}] lists {len(per_rank)} ranks for engine {i} with tp_size={tp}")
        for r, senders in enumerate(per_rank):
            if sorted(stage_of.get(g, -1) for g in senders) != stages:
                raise ValueError(f"tensor_senders[{i}][{r}]={senders} must name one actor rank of each pipeline "
                                 f"stage {stages}")
            for g in senders:
                out.setdefault(g, []).append((i, r))
    return {g: tuple(copies) for g, copies in out.items()}
