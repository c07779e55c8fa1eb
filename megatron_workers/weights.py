"""Weight-sync sender: streaming export from Megatron ranks straight into the inference engines.

Each pipeline stage exports its own layers into flat byte buckets of at most `bucket_bytes` and one
dtype, the engine's (`bucket_by_bytes` plans them from the shapes alone, so every rank cuts the
same buckets). A bucket is filled one of two ways:

- in place (`fill_buckets_in_place`), when the parameters are in host memory, every TP rank of the
  stage runs on this host and one of them sends: each TP rank copies its own shards, cast on the way,
  straight into their places in the sender's shared-memory bucket (`adapters.place_stage_shards`),
  which the other ranks map by name (`SharedMappings`, kept across syncs); nothing crosses the TP
  group but two barriers per bucket;
- by gather (`stream_buckets`), otherwise (GPUs: a device bucket cannot be shared across GPUs): every
  tensor's shards are cast and gathered over the stage's TP group one tensor at a time, re-split into
  HF layout (`adapters.iter_stage_hf_tensors`) and copied into the bucket.

A sender thread ships bucket k while the main thread fills bucket k+1;
a semaphore keeps at most two buckets alive, and they take turns in two buffers (`BucketBuffers`:
bucket k in buffer k % 2). Buffers in host memory are kept across syncs: a fresh shared-memory
buffer costs several times the copy into it (the shm file is created, then every page faults on
first touch: 7-30x the copy in probes on the CPU machine here). Device buffers are
returned to the allocator after each sync, so the engines' KV cache can take that memory back.
`peak_extra_bytes` in the returned metrics is measured, not derived: the largest sum, over the
sync, of bucket bytes in use plus, by gather, the full tensor being copied in (counted when taken,
uncounted when released); the TP gather's shard list, as large as that tensor and freed before the
next one, is not counted.

Two live transports, chosen by the caller's `sync_plan.SyncPlan` (plain data in, plain metrics out):

- tensor: per `SyncPlan.copies`, each copy's filler fills its stage's buckets with its TP group, and
  its serializer (the rank on the engine TP rank's GPU) pickles the bucket's tensors by handle
  (`serialize`: CUDA IPC handles on GPUs; on CPU the shared-memory buffer's name, which each engine
  process maps once and keeps) and calls that engine actor's `load_payload` method; a filler that is
  not the serializer sends it the flat bucket first (`relay`: own buffers there, a fixed global order
  of steps). The engine loads a bucket once all its TP ranks' payloads arrived; the serializer keeps
  the bucket alive until then.
- distributed: the stage's sender is rank 0 of a process group that every engine TP rank joins
  (SGLang's `init_custom_process_group` convention: a `PrefixStore(group_name, TCPStore)` given
  to `_new_process_group_helper`; engine i's ranks at offset 1 + sum of earlier engines' TP
  sizes). Per bucket the sender asks each engine to receive, then broadcasts the flat bucket.

Engine actor handles arrive as plain data (`SyncPlan.engines`) and their Ray methods `load_payload` and
`update_weights_from_distributed` are called; this module imports nothing from rollout or SGLang. Where it
departs from verl/slime: no rank ever holds the whole model, and pipeline stages sync in parallel instead of
through a PP broadcast (on the tensor path, point-to-point to the serializers that need them).
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


from megatron_workers.shared_tensors import SharedMappings, serialize, shared_buffer, shared_name
from megatron_workers.sync_plan import GroupAddress, SyncPlan

NamedTensor = tuple[str, torch.Tensor]

logger = logging.getLogger(__name__)

#: Metadata of one tensor inside a flat bucket: (HF name, dtype name, shape, byte offset).
Slot = tuple[str, str, tuple[int, ...], int]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return tensor.numel() * tensor.element_size()


def bucket_by_bytes(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive groups of `(name, tensor)` of one dtype whose sizes add up to at most `bucket_bytes`,
    in order (tensors may be on the meta device: only shapes and dtypes are read).

    A tensor larger than `bucket_bytes` forms its own bucket. Every tensor appears exactly once.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}; raise update_weights_bucket_megabytes")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        n = tensor_bytes(tensor)
        if bucket and (size + n > bucket_bytes or tensor.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


@dataclass
class Bucket:
    """HF tensors packed back to back in one flat byte buffer."""

    index: int
    flat: torch.Tensor  # (nbytes,) uint8
    slots: list[Slot] = field(default_factory=list)

    def named_tensors(self) -> list[NamedTensor]:
        """Views of the buffer, one per tensor (no copy)."""
        out = []
        for name, dtype, shape, off in self.slots:
            dt = getattr(torch, dtype)
            n = int(torch.Size(shape).numel()) * dt.itemsize
            out.append((name, self.flat[off:off + n].view(dt).view(shape)))
        return out


class MemoryMeter:
    """Live extra bytes at the sender (bucket buffers + the tensor being gathered) and their peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.live += n
            self.peak = max(self.peak, self.live)


class BucketBuffers:
    """The two flat byte buffers a sender's buckets take turns in (bucket k in buffer k % 2, per device).

    Buffers are allocated where other processes can map them (shared memory for host tensors, which
    `serialize` pickles by name; plain device memory for CUDA, which goes by IPC handle), each at the size of
    the largest bucket it serves. `release_device` drops the device buffers; host buffers stay for the next sync.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int, int], torch.Tensor] = {}  # (device, stream, k % 2) -> (capacity,) uint8

    def take(self, index: int, sizes: list[int], device: torch.device, stream: int = -1) -> torch.Tensor:
        """Bucket `index`'s buffer: the first `sizes[index]` bytes of buffer `index % 2` on `device` (no copy);
        `sizes`: every bucket's bytes, in order; `stream`: -1 for this rank's own buckets, a filler's rank for the
        buckets relayed from it (`relay.Relay`)."""
        key, capacity = (str(device), stream, index % 2), max(sizes[index % 2::2])
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < capacity:
            buf = self._buffers[key] = shared_buffer(capacity, device)
        return buf[:sizes[index]]

    def pair(self, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
        """The whole buffers (one per bucket parity, as many as there are buckets, at most two) that `take` hands
        out for buckets of `sizes`."""
        parities = range(min(2, len(sizes)))
        for k in parities:
            self.take(k, sizes, device)
        return [self._buffers[(str(device), -1, k)] for k in parities]

    def release_device(self) -> None:
        """Forget the buffers that are not in host memory and hand their memory back to the GPU (the engines' KV
        cache resumes next)."""
        kept = {k: b for k, b in self._buffers.items() if b.device.type == "cpu"}
        dropped, self._buffers = len(kept) < len(self._buffers), kept
        if dropped:
            torch.cuda.empty_cache()


def stream_buckets(named: Iterator[NamedTensor], plan: list[list[NamedTensor]], meter: MemoryMeter,
                   buffers: BucketBuffers) -> Iterator[Bucket]:
    """Pack a (name, tensor) stream into the buckets of `plan` (from `bucket_by_bytes` on meta tensors).

    Bucket k lies in `buffers.take(k, ...)`, so the consumer must be done with bucket k-2 before bucket k
    is asked for (`send_buckets` ensures it). Every tensor is copied in and dropped at once; the tensors
    lie back to back, unpadded (SGLang's flat-bucket receiver expects that, hence one dtype per bucket).
    The meter counts each arriving tensor until it is copied and each bucket's bytes until the consumer
    releases it (`meter.add(-nbytes)`).
    """
    it = iter(named)
    sizes = [sum(tensor_bytes(t) for _, t in planned) for planned in plan]
    for index, planned in enumerate(plan):
        flat: torch.Tensor | None = None
        bucket = Bucket(index, torch.empty(0, dtype=torch.uint8))
        off = 0
        for want, meta in planned:
            name, t = next(it)
            if name != want or t.shape != meta.shape or t.dtype != meta.dtype:
                raise RuntimeError(f"weight export produced {name} {tuple(t.shape)} {t.dtype} where the bucket plan "
                                   f"expects {want} {tuple(meta.shape)} {meta.dtype}")
            n = tensor_bytes(t)
            meter.add(n)
            if flat is None:
                flat = bucket.flat = buffers.take(index, sizes, t.device)
                meter.add(sizes[index])
            flat[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            bucket.slots.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off))
            off += n
            del t
            meter.add(-n)
        yield bucket
    leftover = next(it, None)
    if leftover is not None:
        raise RuntimeError(f"weight export produced {leftover[0]} beyond the bucket plan")


def fill_buckets_in_place(place: Callable[[dict[str, torch.Tensor]], None], plan: list[list[NamedTensor]],
                          buffers: list[torch.Tensor], group: Any, meter: MemoryMeter) -> Iterator[Bucket]:
    """The buckets of `plan` in `buffers` (bucket k in buffers[k % 2]), each filled by every rank of `group` at once:
    `place({hf name: its view in the bucket})` writes this rank's part. Collective over `group`: a barrier before a
    buffer is reused (every rank has shipped the bucket that held it: ask for bucket k only when done with k-2, as
    `send_buckets` does) and one when the bucket is whole. The meter counts each bucket until the consumer
    releases it."""
    for index, planned in enumerate(plan):
        dist.barrier(group=group)
        flat, slots = buffers[index % 2], planned_slots(planned)
        off = sum(tensor_bytes(meta) for _, meta in planned)
        bucket = Bucket(index, flat[:off], slots)
        place(dict(bucket.named_tensors()))
        dist.barrier(group=group)
        meter.add(off)
        yield bucket


def planned_slots(planned: list[NamedTensor]) -> list[Slot]:
    """The slots of one planned bucket (`bucket_by_bytes` on meta tensors): its tensors back to back, unpadded."""
    slots, off = [], 0
    for name, meta in planned:
        slots.append((name, str(meta.dtype).removeprefix("torch."), tuple(meta.shape), off))
        off += tensor_bytes(meta)
    return slots


def init_sender_group(master_address: str, master_port: int, world_size: int, group_name: str,
                      backend: str) -> dist.ProcessGroup:
    """Create a process group as its rank 0 the way SGLang's engine ranks join it (TCPStore
    served here, keys under `PrefixStore(group_name, ...)`, `_new_process_group_helper`)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                          timeout=dist.constants.default_pg_timeout)
    pg, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=dist.constants.default_pg_timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _host_id() -> tuple[str, str]:
    """This host's name and kernel boot id: equal on two processes that can map each other's shared memory."""
    boot = "/proc/sys/kernel/random/boot_id"
    return socket.gethostname(), Path(boot).read_text().strip() if os.path.exists(boot) else ""


def send_buckets(buckets: Iterator[Bucket], ship, meter: MemoryMeter) -> int:
    """Run `ship(bucket)` in a sender thread while the caller's iterator builds the next bucket;
    at most two buckets are alive at once. Returns the number of buckets shipped."""
    slots = threading.Semaphore(2)
    q: queue.Queue = queue.Queue()
    errors: list[BaseException] = []

    def worker() -> None:
        while (b := q.get()) is not None:
            try:
                if not errors:
                    ship(b)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(e)
            finally:
                meter.add(-b.flat.numel())
                del b
                slots.release()

    thread = threading.Thread(target=worker, name="weight-sender", daemon=True)
    thread.start()
    count = 0
    try:
        it = iter(buckets)
        while True:
            slots.acquire()  # a third bucket waits until the oldest one has been shipped
            b = next(it, None)
            if b is None or errors:
                slots.release()
                break
            q.put(b)
            del b
            count += 1
    finally:
        q.put(None)
        thread.join()
    if errors:
        raise errors[0]
    return count


def send_stage(buckets: Iterator[Bucket], meter: MemoryMeter, *, ship, checksums: bool) -> dict[str, Any]:
    """Ship each of a stage's buckets (see `send_buckets`; `meter` is the one the buckets were packed under).
    Returns seconds, bytes, buckets, peak_extra_bytes and, with `checksums`, per-tensor `stats`."""
    t0 = time.perf_counter()
    stats: dict[str, list[float]] = {}
    nbytes = 0

    def counted() -> Iterator[Bucket]:
        nonlocal nbytes
        for b in buckets:
            if checksums:
                stats.update((name, tensor_stats(t)) for name, t in b.named_tensors())
            nbytes += b.flat.numel()
            yield b

    n = send_buckets(counted(), ship, meter)
    return {"seconds": time.perf_counter() - t0, "bytes": float(nbytes), "buckets": float(n),
            "peak_extra_bytes": float(meter.peak), "stats": stats}


def stage_bucket_plan(hf_config: Any, stage: int, vpp: int, plan: SyncPlan) -> list[list[NamedTensor]]:
    """Pipeline stage `stage`'s buckets under `plan` (`bucket_by_bytes` on meta tensors of the engine dtype), the
    same on every rank that asks (`vpp`: model chunks per stage)."""
    from megatron.core import parallel_state as mpu

    from megatron_workers.adapters import stage_hf_tensor_shapes

    dtype = getattr(torch, plan.dtype)
    shapes = stage_hf_tensor_shapes(hf_config, stage, mpu.get_pipeline_model_parallel_world_size(), vpp)
    return list(bucket_by_bytes([(n, torch.empty(s, dtype=dtype, device="meta")) for n, s in shapes.items()],
                                plan.bucket_bytes))


def _relayed(out: dict[str, Any] | None, relay: Any, seconds: float, peak: int) -> dict[str, Any] | None:
    """`out` with the bytes this rank received as a relay (`relayed_bytes`) and the peak that counts them, or, on a
    rank that only relayed, the metrics of that alone (no bytes of its own, so none counted twice)."""
    if relay is None or (out is None and not relay.relayed):
        return out
    return {"bytes": 0.0, "buckets": 0.0, "stats": {}, **(out or {}), "seconds": seconds,
            "peak_extra_bytes": float(peak), "relayed_bytes": float(relay.relayed)}


def _ship_nothing(b: Bucket) -> None:
    """Ship nothing: checksums only, or a rank that only helps fill (or gather to) the senders' buckets."""


def tensor_stats(t: torch.Tensor, chunk: int = 1 << 20) -> list[float]:
    """[sum, abs_sum, sum_of_squares] in float64, a chunk at a time (no float64 copy of the tensor).
    The engine's probe (`rollout.engines.weight_probe`) computes the same on what it serves."""
    acc = [0.0, 0.0, 0.0]
    flat = t.detach().reshape(-1)
    for i in range(0, flat.numel(), chunk):
        d = flat[i:i + chunk].double()
        acc[0] += float(d.sum())
        acc[1] += float(d.abs().sum())
        acc[2] += float((d * d).sum())
    return acc


class WeightSender:
    """One Megatron rank's side of weight sync (held by the actor role, driven by `recipe.weight_sync`).

    Tensor path: the ranks whose TP group holds a filler of `plan.copies` export (every data-parallel replica that
    shares GPUs with an engine takes part), and every rank ships and relays in one global order (`relay.Relay`).
    Other paths: data-parallel replica 0 exports. In each pipeline stage the TP ranks fill the buckets of the rank(s)
    that send them, in place or by gather (module docstring); engine handles come in
    `plan.engines`.
    """

    def __init__(self) -> None:
        self._groups: dict[str, dist.ProcessGroup] = {}  # distributed path, by group name
        self._buffers = BucketBuffers()  # kept across syncs (host memory)
        self._peer_mappings = SharedMappings()  # of the sender's buffers, on its TP peers (in-place fill)
        self._same_host: bool | None = None  # every TP rank of this stage on this host (asked on the first sync)
        self._relay_group: dist.ProcessGroup | None = None  # tensor path: the relay's point-to-point traffic

    @staticmethod
    def _position() -> tuple[int, int, int]:
        from megatron.core import parallel_state as mpu

        return (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
                mpu.get_data_parallel_rank())

    def endpoint(self) -> GroupAddress | None:
        """On each stage's distributed-path sender (TP rank 0, DP rank 0): where it can host its stage's group.
        None on other ranks."""
        import ray

        from megatron_workers.ports import free_port

        tp_rank, stage, dp_rank = self._position()
        if tp_rank or dp_rank:
            return None
        return GroupAddress(stage, ray.util.get_node_ip_address(), free_port(""), dist.get_backend())

    def init_groups(self, groups: dict[int, GroupAddress]) -> None:
        """Host this stage's group (`groups[stage]`, named and sized by the driver)."""
        tp_rank, stage, dp_rank = self._position()
        g = groups.get(stage)
        if g is None or tp_rank or dp_rank:
            return
        self._groups[g.group_name] = init_sender_group(g.address, g.port, g.world_size, g.group_name, g.backend)

    def destroy_groups(self) -> None:
        for pg in self._groups.values():
            dist.destroy_process_group(pg)
        self._groups.clear()

    def send(self, chunks: list[torch.nn.Module], hf_config: Any, plan: SyncPlan) -> dict[str, Any] | None:
        """Export this stage's tensors (of all its model chunks) and ship them by `plan.transport` (see `SyncPlan`).

        Returns metrics (seconds, bytes, buckets, peak_extra_bytes, stats; relayed_bytes on the tensor path) on ranks
        that received tensors, or relayed some, None elsewhere.
        """
        from megatron.core import parallel_state as mpu

        from megatron_workers.adapters import iter_stage_hf_tensors, place_stage_shards

        tp_rank, stage, dp_rank = self._position()
        tp_group = mpu.get_tensor_model_parallel_group()
        meter = MemoryMeter()
        relay = self._relay(chunks, hf_config, plan, meter) if plan.transport == "tensor" else None
        if relay is not None:
            peers = dist.get_process_group_ranks(tp_group)  # this stage's TP group
            senders = [peers.index(g) for g in peers if g in relay.fillers]  # TP positions that fill
        elif dp_rank or (plan.transport == "distributed" and stage not in plan.groups):  # a stage at a time
            return None
        else:
            senders = [0]
        dtype = getattr(torch, plan.dtype)
        buckets = stage_bucket_plan(hf_config, stage, len(chunks), plan)
        if not senders:  # this replica's stage fills no copy; this rank may still relay other stages' buckets
            receives, filled = False, iter(())
        elif len(senders) == 1 and self._fills_in_place(chunks, tp_group):  # all write their shards into its buckets
            receives = is_owner = tp_rank == senders[0]
            if is_owner:
                sizes = [sum(tensor_bytes(t) for _, t in planned) for planned in buckets]
                buffers = self._buffers.pair(sizes, torch.device("cpu"))
            names = [[(shared_name(b), b.numel()) for b in buffers] if is_owner else None]
            dist.broadcast_object_list(names, src=dist.get_process_group_ranks(tp_group)[senders[0]], group=tp_group)
            if not is_owner:
                buffers = [self._peer_mappings.view(name, n) for name, n in names[0]]
            place = functools.partial(place_stage_shards, chunks, hf_config, replicated=is_owner)
            filled = fill_buckets_in_place(place, buckets, buffers, tp_group, meter)
        else:  # gather each tensor to the sender (or to every TP rank when several serialize), then pack it
            dst = senders[0] if len(senders) == 1 else None
            receives = dst is None or tp_rank == dst
            tensors = iter_stage_hf_tensors(chunks, hf_config, dst_tp_rank=dst, dtype=dtype)
            filled = stream_buckets(tensors, buckets if receives else [], meter, self._buffers)
        # the tensor path ships in the relay's global order on every rank, also on one that only helps fill
        ship = relay.ship if relay is not None else self._shipper(plan, stage) if receives else _ship_nothing
        try:
            out = send_stage(filled, meter, ship=ship, checksums=receives and plan.checksums)
            if relay is not None:
                relay.finish()
        finally:
            self._buffers.release_device()
        return _relayed(out if receives and out["bytes"] else None, relay, out["seconds"], meter.peak)

    def _relay(self, chunks: list[torch.nn.Module], hf_config: Any, plan: SyncPlan, meter: MemoryMeter) -> Any:
        """This rank's `relay.Relay` for a tensor-path sync; makes the relay's process group on the first sync that
        relays (a collective of every rank: each calls `send`)."""
        from megatron.core import parallel_state as mpu

        from megatron_workers.relay import Relay

        if self._relay_group is None and any(c.filler != c.serializer for c in plan.copies):
            self._relay_group = dist.new_group(list(range(dist.get_world_size())))
            dist.barrier(group=self._relay_group)  # NCCL: the group's first call must involve every rank
        me, stage = dist.get_rank(), mpu.get_pipeline_model_parallel_rank()
        plans = {c.stage: stage_bucket_plan(hf_config, c.stage, len(chunks), plan)
                 for c in plan.copies if c.serializer == me != c.filler}
        return Relay(me, stage, plan, self._relay_group, plans, self._buffers, next(chunks[0].parameters()).device,
                     meter)

    def _shipper(self, plan: SyncPlan, stage: int) -> Callable[[Bucket], None]:
        """How this rank ships one bucket of `stage` under `plan`, off the tensor path (`relay.Relay` ships that)."""
        import ray

        if plan.transport == "none":  # checksums only
            return _ship_nothing
        name = plan.groups[stage]
        pg = self._groups[name]

        def ship(b: Bucket) -> None:
            names, dtypes, shapes = [s[0] for s in b.slots], [s[1] for s in b.slots], [list(s[2]) for s in b.slots]
            refs = [e.update_weights_from_distributed.remote(names, dtypes, shapes, group_name=name)
                    for e in plan.engines]
            dist.broadcast(b.flat, src=0, group=pg)
            ray.get(refs)
        return ship

    def _fills_in_place(self, chunks: list[torch.nn.Module], tp_group: Any) -> bool:
        """Whether this stage's TP ranks fill each bucket together, in shared host memory, instead of gathering
        every tensor to the sender: the parameters are in host memory and every TP rank runs on this host (asked
        once; the answer is the same on every rank of the group)."""
        if next(chunks[0].parameters()).device.type != "cpu":
            return False
        if self._same_host is None:
            hosts: list[Any] = [None] * dist.get_world_size(tp_group)
            dist.all_gather_object(hosts, _host_id(), group=tp_group)
            self._same_host = len(set(hosts)) == 1
        return self._same_host
