"""Weight sync from a Megatron TP2 x PP2 actor into SGLang engines hosted in Ray actors.

Contracts: after a PPO update, a sync by the tensor path and, separately, by the distributed path
makes an engine at TP=2 serve exactly the exported HF weights (greedy ids equal transformers', log-probs
within 1e-3), where before the sync it did not, also when each engine TP rank's payloads are serialized by the
rank on its own GPU and the other pipeline stage's buckets are relayed there; several engines end on the same version; the
check finds a corrupted or stale tensor and names it. The sender's bucket pipeline keeps at most two
buckets alive. One Ray cluster, one Megatron group and at most two engine processes' worth of
engines (a TP=2 engine counts double) alive at a time, shared through module fixtures.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import local_ray_cluster

PROMPTS = [[5, 6, 7, 8], [100, 3, 77, 12, 9], [42, 42, 1], [300, 301, 302, 303, 304, 305]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


# ---------------------------------------------------------------------------------------------
# Unit: bucket pipeline and checksum combination (no engine)
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_bucket_pipeline_keeps_at_most_two_buckets_and_every_byte():
    """Buckets hold every tensor once, bit for bit, in order; while a slow sender ships, the gatherer
    never gets more than one bucket ahead (measured peak < 2 buckets + the largest tensor)."""
    from megatron_workers.weights import (
        BucketBuffers,
        MemoryMeter,
        bucket_by_bytes,
        send_buckets,
        stream_buckets,
        tensor_bytes,
    )

    g = torch.Generator().manual_seed(0)
    tensors = [(f"t{i}", torch.randn(int(torch.randint(10, 400, (1,), generator=g)), generator=g).to(
        torch.bfloat16 if i >= 30 else torch.float32)) for i in range(40)]
    bucket_bytes = 2000
    meter = MemoryMeter()
    received = []

    def produced():
        for name, t in tensors:
            yield name, t.clone()

    def ship(bucket):
        time.sleep(0.01)
        received.extend((n, t.clone()) for n, t in bucket.named_tensors())

    plan = list(bucket_by_bytes([(nm, torch.empty(t.shape, dtype=t.dtype, device="meta")) for nm, t in tensors],
                                bucket_bytes))
    n = send_buckets(stream_buckets(produced(), plan, meter, BucketBuffers()), ship, meter)
    assert [nm for nm, _ in received] == [nm for nm, _ in tensors]
    for (_, got), (_, want) in zip(received, tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert n == len(plan) > 5
    assert all(len({t.dtype for _, t in b}) == 1 and (len(b) == 1 or sum(tensor_bytes(t) for _, t in b) <= bucket_bytes)
               for b in plan)
    largest = max(tensor_bytes(t) for _, t in tensors)
    assert meter.live == 0
    assert 0 < meter.peak < 2 * bucket_bytes + largest


@pytest.mark.unit
def test_bucket_buffers_are_reused_and_consecutive_syncs_each_deliver_their_weights():
    """A sender's two bucket buffers outlive a sync: a second and a third sync of different weights pack into the
    same two shared-memory buffers, and the receiver (which maps each bucket by its shared-memory name, as an
    engine does) gets each sync's weights bit for bit, while a slow receiver still holds bucket k when bucket
    k+1 is packed."""
    from multiprocessing.reduction import ForkingPickler

    from megatron_workers.shared_tensors import serialize
    from megatron_workers.weights import (
        BucketBuffers,
        MemoryMeter,
        bucket_by_bytes,
        send_buckets,
        stream_buckets,
    )

    g = torch.Generator().manual_seed(1)
    shapes = [(int(torch.randint(5, 60, (1,), generator=g)),) for _ in range(30)]
    plan = list(bucket_by_bytes([(f"t{i}", torch.empty(s, device="meta")) for i, s in enumerate(shapes)], 600))
    buffers = BucketBuffers()

    def sync(scale: float):
        weights = [(f"t{i}", torch.randn(s, generator=g) * scale) for i, s in enumerate(shapes)]
        received, storages = [], set()

        def ship(bucket):
            storages.add(bucket.flat.untyped_storage().data_ptr())
            time.sleep(0.005)
            received.extend((n, t.clone()) for n, t in ForkingPickler.loads(serialize(bucket.named_tensors())))

        send_buckets(stream_buckets(iter([(n, t.clone()) for n, t in weights]), plan, MemoryMeter(), buffers),
                     ship, MemoryMeter())
        assert [n for n, _ in received] == [n for n, _ in weights]
        assert all(torch.equal(got, want) for (_, got), (_, want) in zip(received, weights))
        return storages

    first = sync(1.0)
    assert len(plan) > 4 and len(first) == 2
    assert sync(3.0) == first
    buffers.release_device()  # host buffers stay
    assert sync(5.0) == first


def _mappings_of(name: str) -> int:
    """How many mappings of shared-memory file `name` this process holds (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(name.lstrip("/") in line for line in f)


@pytest.mark.unit
def test_a_receiver_maps_a_senders_buffer_once_and_drops_the_mapping_once_the_buffer_is_freed():
    """Host buckets arrive by shared-memory name: the receiving process maps a sender's buffer the first time and
    reads later buckets in it through the same mapping (a fresh one per bucket costs page faults, then an unmap),
    at the storage's own bytes (torch keeps a header before them in the file). Once the sender frees the buffer,
    torch unlinks its file, and the receiver drops its mapping when it next maps a buffer: nothing outlives both."""
    import pickle

    from megatron_workers.shared_tensors import serialize
    from megatron_workers.weights import BucketBuffers

    first, second = BucketBuffers(), BucketBuffers()
    buf = first.take(0, [4096], torch.device("cpu"))
    name = buf.untyped_storage()._share_filename_cpu_()[1].decode()
    for fill in (1.0, 2.0):  # two syncs' buckets in the same buffer
        buf.view(torch.float32)[:] = fill
        (got,) = pickle.loads(serialize([buf[64:1088].view(torch.float32).view(16, 16)]))
        assert torch.equal(got, torch.full((16, 16), fill))
        if fill == 1.0:
            ptr = got.untyped_storage().data_ptr()
        assert got.untyped_storage().data_ptr() == ptr  # the kept mapping
        del got
    assert _mappings_of(name) == 2  # the sender's own and the receiver's
    del first, buf
    assert _mappings_of(name) == 1  # the receiver's, of the unlinked file
    other = second.take(0, [4096], torch.device("cpu"))
    pickle.loads(serialize([other[:8]]))
    assert _mappings_of(name) == 0


def _map_and_wait(name: str, nbytes: int, ready) -> None:
    """A TP peer: write into the sender's buffer through a kept mapping, then wait to be killed."""
    from megatron_workers.shared_tensors import SharedMappings

    SharedMappings().view(name, nbytes).fill_(7)
    ready.set()
    time.sleep(600)


@pytest.mark.unit
def test_a_peer_killed_while_it_maps_the_senders_buffer_leaves_nothing_behind():
    """A TP peer writes into the sender's bucket buffer through its kept mapping; killed while it holds it, it
    leaves no reference behind: when the sender frees the buffer, its shared-memory file is gone."""
    import multiprocessing
    import os

    from megatron_workers.weights import BucketBuffers

    buffers = BucketBuffers()
    buf = buffers.take(0, [1 << 16], torch.device("cpu"))
    name = buf.untyped_storage()._share_filename_cpu_()[1].decode()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    peer = ctx.Process(target=_map_and_wait, args=(name, buf.numel(), ready))
    peer.start()
    try:
        assert ready.wait(120)
        assert torch.equal(buf, torch.full_like(buf, 7))  # the peer wrote the storage's bytes, not torch's header
    finally:
        peer.kill()
        peer.join()
    del buffers, buf
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")


class _FakeGroup:
    """A TP2 x PP2 actor group's weight-sync methods, recording the calls (no ranks)."""

    def __init__(self, calls: list) -> None:
        from types import SimpleNamespace

        self.calls = calls
        self.ranks = [SimpleNamespace(rank=r, pp_rank=r // 2, tp_rank=r % 2, dp_rank=0) for r in range(4)]

    def send_weights(self, plan):
        self.calls.append(("send_weights", plan))
        return [None] * 4

    def weight_sync_endpoints(self):
        from megatron_workers.sync_plan import GroupAddress

        return [GroupAddress(s, "a", 1, "gloo") for s in (0, 1)]

    def init_weight_sync_groups(self, groups):
        self.calls.append(("init_weight_sync_groups", groups))

    def destroy_weight_sync_groups(self):
        self.calls.append(("destroy_weight_sync_groups", None))

    def export_hf(self, path):
        self.calls.append(("export_hf", path))


class _FakeEngine:
    """An EngineClient's typed control methods, recording the calls; serves what the session closed under."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.tp_size, self.handle, self.weight_version, self.calls = name, 1, object(), 0, calls
        self._version = 0

    def __getattr__(self, method: str):
        def record(*args, **kwargs):
            self.calls.append((f"{self.name}.{method}", args))
            if method in ("finish_weight_update", "update_weights_from_disk"):
                self._version = args[0] if method == "finish_weight_update" else kwargs["weight_version"]
        return record

    def refresh(self) -> int:
        self.weight_version = self._version
        return self._version


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_each_path_connects_once_and_syncs_by_typed_calls(mode, tmp_path):
    """Contract: `update_weights_mode` picks one path class, chosen once; the driver reaches the ranks and the engines
    by typed calls only, with a typed `SyncPlan`. The distributed path connects (one group per stage, every engine
    joining) before its first sync only, and ships one pipeline stage's group at a time (an engine serves one weight
    update at a time: two stages broadcasting at once could each hold an engine the other's group waits for); the
    tensor path ships every stage at once, with the serializers; the disk path exports, then each engine reloads.
    A restarted engine makes the next sync connect anew."""
    from megatron_workers.sync_plan import SyncPlan
    from recipe.weight_sync import PATHS, WeightSync

    calls: list = []
    engines = [_FakeEngine("e0", calls), _FakeEngine("e1", calls)]
    sync = WeightSync(_FakeGroup(calls), engines, mode=mode, bucket_bytes=1 << 20, engine_dtype="bfloat16",
                      check=False, disk_dir=str(tmp_path))
    assert type(sync.path) is PATHS[mode]
    for version in (7, 8):
        sync.sync(version)
        assert [e.weight_version for e in engines] == [version, version]
    plans = [p for m, p in calls if m == "send_weights"]
    assert all(isinstance(p, SyncPlan) and p.engines == (engines[0].handle, engines[1].handle) for p in plans)
    joins = [m for m, _ in calls if m.endswith("init_weights_update_group")]
    if mode == "distributed":
        assert [sorted(p.groups) for p in plans] == [[0], [1]] * 2
        assert {p.transport for p in plans} == {"distributed"}
        assert len(joins) == 4 and [m for m, _ in calls].count("init_weight_sync_groups") == 1
    elif mode == "tensor":
        assert len(plans) == 2 and {p.transport for p in plans} == {"tensor"} and not joins
        assert [(c.engine, c.stage, c.filler, c.serializer) for c in plans[0].copies] == [  # each stage's first rank
            (0, 0, 0, 0), (0, 1, 2, 2), (1, 0, 0, 0), (1, 1, 2, 2)]
    else:
        assert plans == [] and [p for m, p in calls if m == "export_hf"] == [str(tmp_path)] * 2
        assert [m for m, _ in calls if m.endswith("update_weights_from_disk")] == ["e0.update_weights_from_disk",
                                                                                     "e1.update_weights_from_disk"] * 2
    sessions = [m.split(".")[1] for m, _ in calls if m.startswith("e0.") and m.endswith("weight_update")]
    assert sessions == ([] if mode == "disk" else ["begin_weight_update", "finish_weight_update"] * 2)

    calls.clear()
    sync.forget_groups([engines[1]])
    sync.sync(9)
    if mode == "distributed":  # torn down on the senders and on the engine still in the groups, then made anew
        assert [m for m, _ in calls if "destroy" in m] == ["e0.destroy_weights_update_group"] * 2 + [
            "destroy_weight_sync_groups"]
        assert sum(m.endswith("init_weights_update_group") for m, _ in calls) == 4
    sync.close()


@pytest.mark.unit
def test_probe_combine_counts_replicas_once_and_names_mismatches(tmp_path):
    """Per-rank probe files add up to the full tensor's statistics (replicated copies counted once);
    mismatches name the tensor, a missing one too; a missing rank's file is an error."""
    import json

    from rollout.engines.weight_probe import combine, mismatches, tensor_stats

    full = torch.randn(4, 6, dtype=torch.float64)
    norm = torch.randn(6, dtype=torch.float64)
    for r in range(2):
        part = {"w": [*tensor_stats(full[2 * r:2 * r + 2]), 1.0], "norm": [*tensor_stats(norm), 2.0]}
        (tmp_path / f"rank-{r}.json").write_text(json.dumps(part))
    got = combine(str(tmp_path), 2)
    expected = {"w": tensor_stats(full), "norm": tensor_stats(norm)}
    assert mismatches(expected, got) == []
    bad = dict(got, w=[got["w"][0] + 1.0, *got["w"][1:]])
    assert [m.split(" ")[0] for m in mismatches(expected, bad)] == ["w"]
    assert "not served" in mismatches({**expected, "extra": [0, 0, 0]}, got)[0]
    with pytest.raises(RuntimeError, match="1 of 2"):
        (tmp_path / "rank-1.json").unlink()
        combine(str(tmp_path), 2)


# ---------------------------------------------------------------------------------------------
# Integration: Megatron TP2 x PP2 -> SGLang engines in Ray actors
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import cloudpickle

    from tests import test_actor  # its loss function and role factory are shipped to the ranks by value

    with local_ray_cluster(tmp_path_factory, num_cpus=4, pickle_by_value=__name__):
        cloudpickle.register_pickle_by_value(test_actor)
        yield


@pytest.fixture(scope="module")
def actor_group(cluster):
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout

    group = MegatronWorkerGroup(ParallelLayout(tp=2, pp=2), seed=1)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def engines(cluster, tiny_model_dir):
    """`engines(tp_sizes)`: engine clients on the tiny checkpoint (fp32); a different request shuts
    the previous ones down first, so at most two engine processes' worth are alive."""
    from rollout.engines.engine_actor import EngineClient

    current: dict[str, object] = {"key": None, "engines": []}

    def get(tp_sizes: tuple[int, ...]):
        if current["key"] != tp_sizes:
            for e in current["engines"]:
                e.shutdown()
            with ThreadPoolExecutor(len(tp_sizes)) as pool:  # engines start side by side
                current["engines"] = list(pool.map(lambda i: EngineClient.launch(
                    str(tiny_model_dir), name=f"engine{i}", ray_options={}, tp_size=tp_sizes[i], dtype="float32",
                    random_seed=0, max_total_tokens=2048, log_level="error"), range(len(tp_sizes))))
            current["key"] = tp_sizes
        for e in current["engines"]:  # every test starts from the checkpoint's weights
            e.update_weights_from_disk(str(tiny_model_dir), weight_version=0)
        return current["engines"]

    yield get
    for e in current["engines"]:
        e.shutdown()


def _trained_actor(group, model_dir, seed: int) -> None:
    """Build the actor from the checkpoint and take one PPO step (clipped surrogate, lr 1e-3)."""
    from tests.test_actor import build_actor, ppo_batch, update

    build_actor(group, model_dir)
    update(group, ppo_batch(model_dir, seed=seed), mini_batch_size=8)


def _engine_greedy(engine) -> list:
    async def run():
        return await asyncio.gather(*[engine.generate(p, GREEDY, f"g{i}-{time.monotonic_ns()}")
                                      for i, p in enumerate(PROMPTS)])
    return asyncio.run(run())


def _hf_greedy_all(model_dir) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    for p in PROMPTS:
        gen = model.generate(torch.tensor([p]), max_new_tokens=GREEDY["max_new_tokens"], do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        ids = gen.sequences[0, len(p):].tolist()
        out.append((ids, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.logits, ids)]))
    return out


def _matches(results, reference) -> bool:
    for res, (ids, logprobs) in zip(results, reference):
        n = len(res.output_ids)
        if res.output_ids != ids[:n] or max(abs(a - b) for a, b in zip(res.output_logprobs, logprobs)) >= 1e-3:
            return False
    return True


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_sync_after_ppo_update_engine_tp2_serves_exported_weights(mode, actor_group, engines, tiny_model_dir,
                                                                   tmp_path):
    """After a PPO update of the TP2 x PP2 actor, a sync by `mode` into an engine at TP=2 makes its greedy
    ids equal transformers' on the exported HF weights (log-probs within 1e-3); before, they differ. After a
    second update, a second sync (through the senders' reused bucket buffers) lands too: the check passes."""
    from recipe.weight_sync import WeightSync
    from tests.test_actor import ppo_batch, update

    (engine,) = engines((2,))
    _trained_actor(actor_group, tiny_model_dir, seed={"tensor": 4, "distributed": 5}[mode])
    exported = tmp_path / "exported"
    actor_group.call_all("export_hf", str(exported))
    reference = _hf_greedy_all(exported)
    assert not _matches(_engine_greedy(engine), reference), "the engine already served the trained weights"

    sync = WeightSync(actor_group, [engine], mode=mode, bucket_bytes=1 << 18, engine_dtype="float32", check=True)
    metrics = sync.sync(version=7)
    after = _engine_greedy(engine)
    assert _matches(after, reference)
    assert engine.weight_version == 7 and all(r.weight_version == 7 for r in after)
    assert metrics["weight_sync/buckets"] > 2  # several buckets per stage: the pipeline was exercised
    assert 0 < metrics["weight_sync/peak_extra_mb"] * 2**20 < 2 * (1 << 18) + max_tensor_bytes(exported)

    first = sync.expected
    update(actor_group, ppo_batch(tiny_model_dir, seed=10), mini_batch_size=8)
    sync.sync(version=8)  # check=True: raises unless the engine serves the second update's weights
    sync.close()
    assert sync.expected != first and engine.weight_version == 8


@pytest.mark.integration
def test_tensor_sync_relays_the_other_stage_to_the_rank_on_each_engine_ranks_gpu(actor_group, engines, tiny_model_dir,
                                                                                tmp_path):
    """Contract (hybrid, PP=2): with the placement plan's copies (engine TP rank r's payloads serialized by the rank
    on its GPU, the other stage's buckets filled by that stage's rank and relayed to it point-to-point), an engine at
    TP=2 ends the sync serving exactly the exported weights (greedy ids and log-probs as transformers'; checked). A
    layout where two ranks each fill their own stage and relay it to the other at once (engine TP ranks on the GPUs
    of ranks 0 and 2, one per stage) lands too, with no deadlock, after a second update."""
    import math

    from transformers import AutoConfig

    from megatron_workers.adapters import stage_hf_tensor_shapes
    from megatron_workers.sync_plan import Copy
    from recipe.placement import TRAINER, Bundle, EnginePlacement, PlacementPlan, Pool
    from recipe.weight_sync import WeightSync
    from tests.test_actor import ppo_batch, update

    (engine,) = engines((2,))
    _trained_actor(actor_group, tiny_model_dir, seed=7)
    exported = tmp_path / "exported"
    actor_group.call_all("export_hf", str(exported))
    reference = _hf_greedy_all(exported)
    assert not _matches(_engine_greedy(engine), reference), "the engine already served the trained weights"

    # the hybrid plan of this TP2 x PP2 actor on one 4-GPU node with engines at TP2; engine 0 is this one
    plan = PlacementPlan(True, {TRAINER: Pool(1, 4, 2)}, ("actor",), 4, tuple(
        EnginePlacement(Bundle(TRAINER, 0, gpu), 2) for gpu in (0, 2)), tp=2, pp=2)
    copies = tuple(c for c in plan.tensor_copies if c.engine == 0)
    assert [(c.stage, c.filler, c.serializer) for c in copies] == [(0, 0, 0), (1, 2, 0), (0, 1, 1), (1, 3, 1)]
    sync = WeightSync(actor_group, [engine], mode="tensor", bucket_bytes=1 << 18, engine_dtype="float32", check=True,
                      tensor_copies=copies)
    metrics = sync.sync(version=7)
    assert _matches(_engine_greedy(engine), reference) and engine.weight_version == 7
    shapes = stage_hf_tensor_shapes(AutoConfig.from_pretrained(tiny_model_dir), 1, 2)
    stage1 = 4 * sum(math.prod(shape) for shape in shapes.values())  # float32 bytes of stage 1's tensors
    assert metrics["weight_sync/relayed_bytes"] == 2 * stage1 > 0  # stage 1, once to each engine TP rank's GPU
    first = sync.expected

    update(actor_group, ppo_batch(tiny_model_dir, seed=11), mini_batch_size=8)
    crossed = (Copy(0, 0, 0, 0, 0), Copy(0, 0, 1, 2, 0), Copy(0, 1, 0, 0, 2), Copy(0, 1, 1, 2, 2))
    sync = WeightSync(actor_group, [engine], mode="tensor", bucket_bytes=1 << 18, engine_dtype="float32", check=True,
                      tensor_copies=crossed)
    metrics = sync.sync(version=8)  # check=True: raises unless the engine serves the second update's weights
    assert sync.expected.keys() == first.keys() and sync.expected != first and engine.weight_version == 8
    assert metrics["weight_sync/relayed_bytes"] == metrics["weight_sync/bytes"]  # each stage relayed to the other
    sync.close()


def max_tensor_bytes(model_dir) -> int:
    from safetensors.torch import load_file

    return max(t.numel() * 4 for t in load_file(str(model_dir / "model.safetensors")).values())


@pytest.mark.integration
def test_two_engines_same_version_and_corrupted_tensor_is_named(actor_group, engines, tiny_model_dir):
    """Two engines end a checked sync on the same version; a tensor corrupted afterwards on one engine,
    and an engine left on the old weights, are caught by the check and named."""
    import ray

    from megatron_workers.shared_tensors import serialize
    from megatron_workers.sync_plan import Copy
    from recipe.weight_sync import WeightSync, WeightSyncError

    e0, e1 = engines((1, 1))
    _trained_actor(actor_group, tiny_model_dir, seed=6)
    # as the hybrid plan assigns them on GPUs 0 and 1 of a TP2 x PP2 actor: each engine's stage-0 payload from the rank
    # on its GPU, stage 1 from the same TP position in stage 1, so both TP ranks of both stages serialize
    copies = (Copy(0, 0, 0, 0, 0), Copy(0, 0, 1, 2, 2), Copy(1, 0, 0, 1, 1), Copy(1, 0, 1, 3, 3))
    sync = WeightSync(actor_group, [e0, e1], mode="tensor", bucket_bytes=1 << 18, engine_dtype="float32", check=True,
                      tensor_copies=copies)
    assert sync.path.copies == copies
    sync.sync(version=3)
    assert [e.weight_version for e in (e0, e1)] == [3, 3]
    assert _engine_greedy(e0)[0].output_ids == _engine_greedy(e1)[0].output_ids

    name = "model.layers.1.mlp.down_proj.weight"
    served = sync.expected  # what the senders sent, by HF name
    assert name in served
    from safetensors.torch import load_file

    bad = load_file(str(tiny_model_dir / "model.safetensors"))[name] * 0  # any wrong value
    e1.begin_weight_update()  # one bucket by the tensor path's receive side, as a sender ships it
    ray.get(e1.handle.load_payload.remote("corrupt", 0, serialize([(name, bad)])))
    e1.finish_weight_update(3)
    with pytest.raises(WeightSyncError, match=rf"engine1 serves 1 tensor\(s\).*{name}"):
        sync.verify()
    sync.verify(engines=[e0])  # the other engine is fine

    e0.update_weights_from_disk(str(tiny_model_dir), weight_version=3)  # stale: the pre-update weights
    with pytest.raises(WeightSyncError, match="engine0 serves"):
        sync.verify(engines=[e0])


@pytest.mark.integration
def test_engine_clients_route_abort_and_release(engines):
    """Through EngineClient handles only: the router spreads trajectories over two engine actors running
    many requests at once; an abort ends a request with finish_reason "abort"; release/resume of memory leave the
    engine serving."""
    from rollout.engines.router import EngineRouter

    e0, e1 = engines((1, 1))
    router = EngineRouter([e0, e1])

    async def routed():
        return await asyncio.gather(*[router.generate(f"traj{i}", p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)])

    results = asyncio.run(routed())
    assert {router.engine_for(f"traj{i}") for i in range(len(PROMPTS))} == {0, 1}
    assert all(r.finish_reason == "length" and len(r.output_ids) == 8 for r in results)

    async def abort_one():
        task = asyncio.create_task(e0.generate([9, 10, 11], {"max_new_tokens": 1500, "temperature": 1.0,
                                                              "ignore_eos": True}, "to-abort"))
        await asyncio.sleep(1.0)
        await e0.abort("to-abort")
        return await asyncio.wait_for(task, timeout=120)

    aborted = asyncio.run(abort_one())
    assert aborted.finish_reason == "abort" and len(aborted.output_ids) < 1500

    e1.release_memory_occupation()
    e1.resume_memory_occupation()
    assert len(_engine_greedy(e1)[0].output_ids) == 8
    assert e0.num_inflight == e1.num_inflight == 0
