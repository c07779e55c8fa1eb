"""The tensor path's shipping on one rank: its own stage's copies, and the relay of other stages' buckets.

With PP > 1 the rank on an engine TP rank's GPU holds one pipeline stage, but the engine rank needs all of them, and
a CUDA IPC handle must point to memory on the engine rank's own GPU. So each `sync_plan.Copy` names a filler (a rank
of the stage: it fills the buckets with its TP group) and a serializer (the rank on the engine rank's GPU: it pickles
the handles). When they differ, the filler sends each flat bucket to the serializer over torch.distributed
point-to-point (NCCL on GPUs, within or between nodes; gloo on CPU), and the serializer receives it into a buffer of
its own (per incoming stream, bucket k in buffer k % 2, one in use at a time) and serializes from there.

Why nothing deadlocks, although a rank can fill its own stage and relay others at once: every transfer and every
hand-over belongs to a step (bucket index k, stage s), and each rank runs its steps in that one global order, all on
one thread (the sender thread of `weights.send_buckets`: before shipping its own bucket k it runs its earlier
receive steps; the steps after its own last bucket follow on the main thread). A step posts all of the rank's sends
and receives of that step at once (`batch_isend_irecv`, on a process group used for nothing else, so the TP
collectives that fill buckets on the main thread never interleave with it), waits for them, and only then hands its
payloads to the engines, which wait for every TP rank's copy of that bucket, all handed over in this same step. A
step thus waits only on its own transfers and on earlier steps (a filler's bucket k needs its TP group's bucket k-2
shipped), so by induction over the order every step completes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_workers.shared_tensors import serialize
from megatron_workers.sync_plan import Copy, SyncPlan
from megatron_workers.weights import Bucket, BucketBuffers, MemoryMeter, NamedTensor, planned_slots, tensor_bytes


class Relay:
    """Rank `me`'s steps of one tensor-path sync (`plan.copies`); `stage_plans[s]`: stage s's bucket plan
    (`bucket_by_bytes` on meta tensors) for every stage this rank receives; received buckets go in `buffers` on
    `device` and count in `meter`. `group`: the relay's process group (None when no copy is relayed)."""

    def __init__(self, me: int, stage: int, plan: SyncPlan, group: Any, stage_plans: dict[int, list[list[NamedTensor]]],
                 buffers: BucketBuffers, device: torch.device, meter: MemoryMeter) -> None:
        self.stage, self.key, self.engines, self.group = stage, plan.key, plan.engines, group
        self.stage_plans, self.buffers, self.device, self.meter = stage_plans, buffers, device, meter
        # each received stage's bucket sizes in bytes, by bucket index (the buffers' capacities)
        self.sizes = {s: [sum(tensor_bytes(t) for _, t in planned) for planned in plan_s]
                      for s, plan_s in stage_plans.items()}
        self.fillers = {c.filler for c in plan.copies}
        self.own = [c for c in plan.copies if c.filler == me == c.serializer]  # filled and serialized here
        self.targets = sorted({c.serializer for c in plan.copies if c.filler == me != c.serializer})
        incoming: dict[tuple[int, int], list[Copy]] = {}  # (stage, filler) -> the copies serialized here
        for c in plan.copies:
            if c.serializer == me != c.filler:
                incoming.setdefault((c.stage, c.filler), []).append(c)
        # this rank's receive steps, in the global order: (bucket index, stage, filler, copies)
        self.pending = sorted((k, s, f, tuple(cs)) for (s, f), cs in incoming.items() for k in range(len(stage_plans[s])))
        self.relayed = 0  # bytes received from fillers

    def ship(self, bucket: Bucket) -> None:
        """Ship this rank's bucket `bucket.index` of its own stage (a rank that only helps fill it sends nothing),
        after this rank's receive steps that come before it."""
        self._steps_before((bucket.index, self.stage))
        self._step(bucket.index, self.stage, bucket)

    def finish(self) -> None:
        """The receive steps after this rank's own last bucket."""
        self._steps_before((float("inf"), 0))

    def _steps_before(self, step: tuple[float, int]) -> None:
        while self.pending and self.pending[0][:2] < step:
            self._step(*self.pending[0][:2])

    def _step(self, k: int, stage: int, own: Bucket | None = None) -> None:
        import ray

        ops, received = [], []
        if own is not None:
            ops = [dist.P2POp(dist.isend, own.flat, x, self.group) for x in self.targets]
        while self.pending and self.pending[0][:2] == (k, stage):
            _, _, filler, copies = self.pending.pop(0)
            flat = self.buffers.take(k, self.sizes[stage], self.device, stream=filler)
            received.append((Bucket(k, flat, planned_slots(self.stage_plans[stage][k])), copies))
            ops.append(dist.P2POp(dist.irecv, flat, filler, self.group))
            self.meter.add(flat.numel())
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        refs = [ref for b, copies in received for ref in self._hand_over(b, stage, copies)]
        if own is not None:
            refs += self._hand_over(own, stage, self.own)
        try:
            ray.get(refs)
        finally:
            for b, _ in received:
                self.relayed += b.flat.numel()
                self.meter.add(-b.flat.numel())

    def _hand_over(self, b: Bucket, stage: int, copies: list[Copy] | tuple[Copy, ...]) -> list[Any]:
        """One payload per copy, by handle to `b`'s memory on this rank (the engine actor's `load_payload`)."""
        named = b.named_tensors()
        key = f"{self.key}/stage{stage}/bucket{b.index}"
        return [self.engines[c.engine].load_payload.remote(key, c.tp_rank, serialize(named)) for c in copies]
