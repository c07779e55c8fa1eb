"""The plain data the driver's weight sync (`recipe.weight_sync`) hands every actor rank (`weights.WeightSender`).

Frozen dataclasses of ints, strings and Ray actor handles: no torch, no Megatron, so the driver (and the placement
plan, before Ray) imports them without either. `SyncPlan` is one sync's instructions; `Copy` is one engine TP rank's
copy of one pipeline stage on the tensor path; `GroupAddress` is where a stage's distributed-path sender hosts the
process group the engines join.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: How a rank ships its buckets: by handle to each engine TP rank, by broadcast over a process group, or not at
#: all (the ranks only report checksums, e.g. for a sync from disk).
TRANSPORTS = ("tensor", "distributed", "none")


@dataclass(frozen=True)
class Copy:
    """Tensor path: engine `engine`'s TP rank `tp_rank` gets pipeline stage `stage`'s buckets. Rank `filler` (of
    that stage) fills them with its TP group; rank `serializer` (the one on the engine rank's GPU, in hybrid
    placement) pickles their handles. When the two differ, the filler sends each flat bucket to the serializer
    first (`megatron_workers.relay`), so no handle points to another GPU's memory."""

    engine: int  # index into SyncPlan.engines
    tp_rank: int
    stage: int
    filler: int  # global Megatron rank
    serializer: int  # global Megatron rank


@dataclass(frozen=True)
class SyncPlan:
    """One sync, as every actor rank reads it (`MegatronActor.send_weights`)."""

    transport: str  # one of TRANSPORTS
    key: str  # unique per sync: names the tensor path's buckets on the engines
    bucket_bytes: int  # most bytes per bucket
    dtype: str  # the engines' dtype name ("bfloat16"): tensors are cast to it on the way
    checksums: bool  # the ranks that ship return per-tensor [sum, abs_sum, sum_of_squares]
    engines: tuple[Any, ...] = ()  # engine actor handles (`EngineActor`), by engine index
    copies: tuple[Copy, ...] = ()
    """tensor: one `Copy` per (engine, engine TP rank, pipeline stage)."""
    groups: dict[int, str] = field(default_factory=dict)
    """distributed: {pipeline stage: process-group name}; a stage not listed sends nothing this call."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"SyncPlan.transport={self.transport!r} is not one of {TRANSPORTS}")
        if self.bucket_bytes < 1:
            raise ValueError(f"SyncPlan.bucket_bytes={self.bucket_bytes} must be >= 1; raise "
                             "actor_rollout_ref.rollout.update_weights_bucket_megabytes")


@dataclass(frozen=True)
class GroupAddress:
    """Distributed path: the process group of pipeline stage `stage`, hosted by its sender (rank 0 of the group)."""

    stage: int
    address: str  # the sender's node address
    port: int  # a free port there (the group's TCPStore)
    backend: str  # torch.distributed backend ("nccl", "gloo")
    world_size: int = 0  # 1 + every engine TP rank; 0 until the driver has counted them
    group_name: str = ""  # unique per group; "" until the driver names it
