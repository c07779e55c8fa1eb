"""The tensor path (colocated / hybrid placement): each bucket handed over by handle on the engine's own GPU.

Every engine TP rank gets every pipeline stage's buckets as one `sync_plan.Copy` says (`PlacementPlan.tensor_copies`):
the copy's filler (a rank of that stage) fills them with its TP group, and its serializer (the rank on the engine
rank's GPU) pickles them by handle (CUDA IPC on GPUs, a shared-memory name on CPU) and hands them to the engine actor
(`EngineActor.load_payload`). A filler that is not the serializer first sends each flat bucket to it over
torch.distributed (`megatron_workers.relay`), so a handle never points to another GPU's memory. Every stage ships at
once, inside one weight-update session per engine.
"""
from __future__ import annotations

import dataclasses

from megatron_workers.sync_plan import Copy, SyncPlan
from recipe.weight_sync.base import Sent, SyncPath, in_session


class TensorSync(SyncPath):
    """`copies`: every (engine, engine TP rank, stage)'s `Copy`, checked against the actor group's ranks."""

    def __init__(self, group, engines, *, tensor_copies: tuple[Copy, ...] | None = None,
                 disk_dir: str | None = None) -> None:
        """`tensor_copies`: `PlacementPlan.tensor_copies`; None: each stage's first rank (TP 0, DP 0) fills and
        serializes every copy of that stage itself (no relay)."""
        super().__init__(group, engines)
        self.copies = checked_copies(group.ranks, [e.tp_size for e in engines], tensor_copies)

    def update(self, version: int, plan: SyncPlan) -> Sent:
        plan = dataclasses.replace(plan, transport="tensor", copies=self.copies)
        return in_session(self.engines, version, lambda: self.group.send_weights(plan))


def checked_copies(ranks, tp_sizes: list[int], copies: tuple[Copy, ...] | None) -> tuple[Copy, ...]:
    """`copies` (see `TensorSync.__init__`), checked against the group's `ranks` (`RankInfo`): every (engine, engine
    TP rank, pipeline stage) exactly once, filled by a rank of that stage and serialized by an actor rank; raises
    ValueError naming the first that is not."""
    stage_of = {info.rank: info.pp_rank for info in ranks}
    stages = sorted(set(stage_of.values()))
    if copies is None:
        firsts = {s: min(i.rank for i in ranks if i.pp_rank == s and i.tp_rank == 0 and i.dp_rank == 0) for s in stages}
        return tuple(Copy(i, r, s, firsts[s], firsts[s]) for i, tp in enumerate(tp_sizes) for r in range(tp)
                     for s in stages)
    want = sorted((i, r, s) for i, tp in enumerate(tp_sizes) for r in range(tp) for s in stages)
    got = sorted((c.engine, c.tp_rank, c.stage) for c in copies)
    if got != want:
        raise ValueError(f"tensor_copies covers (engine, engine TP rank, stage) {got}; every one of {want} must be "
                         "covered exactly once")
    for c in copies:
        if stage_of.get(c.filler) != c.stage or c.serializer not in stage_of:
            raise ValueError(f"{c}: the filler must be an actor rank of stage {c.stage} and the serializer an actor "
                             f"rank (ranks by stage: {stage_of})")
    return tuple(copies)
