"""Placement: nodes x GPUs -> Ray placement groups, and which role runs on which bundle.

`plan_placement(cfg)` is pure and runs before Ray starts: it turns `trainer.nnodes` x
`trainer.n_gpus_per_node` (and, in separate mode, `rollout.nnodes` x `rollout.n_gpus_per_node`)
into pools of one bundle per GPU, packed per node, and assigns them:

- Megatron rank `g` of every role (actor, reference, critic) sits on trainer bundle `g`: node
  `g // n_gpus_per_node`, local GPU `g % n_gpus_per_node`, whatever the role's own TP x PP layout
  (each role is a Megatron group of its own over all trainer ranks). The roles share each GPU.
- `hybrid` (`actor_rollout_ref.hybrid_engine=true`, the default, as in verl): engine `i` with TP
  size `T` uses its node's GPUs `i*T .. i*T+T-1` of the trainer pool (SGLang `base_gpu_id`), so
  there are `trainer GPUs / T` engines, colocated with the Megatron ranks. Weight sync hands
  tensors over on the GPU (`tensor_copies`, one `sync_plan.Copy` per engine i, engine TP rank r and
  pipeline stage s): the *serializer* is always the Megatron rank on engine rank r's own GPU, so no
  CUDA IPC handle ever crosses GPUs; the *filler* is the rank of stage s that fills the buckets: the
  serializer itself when it holds stage s (always with PP=1), else stage s's rank with the same TP
  position, on the same node when there is one, nearest the serializer's own data-parallel replica
  (so the replicas share the work). A filler that is not the serializer sends it each bucket over
  torch.distributed (`megatron_workers.relay`), within a node or between nodes: a plan whose stages
  lie on other nodes than an engine (2 nodes, PP=2) runs too.
- `separate` (`hybrid_engine=false`): the engines get their own pool, `rollout GPUs / T` of them.

Errors name the config key and the fix. `Placement(plan)` makes the plan real on the Ray cluster
the driver has joined: one STRICT_PACK placement group per pool node. A cluster with GPUs gets
`{"GPU": 1, "CPU": c}` bundles; a cluster without any (CPU machines) gets `{"CPU": c}` bundles
for the same plan; which one is read from the cluster's resources. Every process on a bundle
claims an equal share of it (`1 / occupants`), so all of them schedule at once.

Where it departs from verl: one plan for every role instead of per-role resource pools (the ref
and critic never need GPUs of their own); an engine is its own Ray actor, placed on the bundle of
its first GPU, and sees all of its node's GPUs (Ray would set CUDA_VISIBLE_DEVICES to the one GPU
of its fractional share, so `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES` is set for it and
`base_gpu_id` picks its GPUs, as verl and slime do for SGLang). In hybrid placement on GPUs every rank and
engine also gets `NCCL_MULTI_RANK_GPU_ENABLE=1`: the distributed weight-sync path puts a stage's sender and the
engine rank on the same GPU into one NCCL group, which NCCL otherwise refuses ("Multiple Ranks are using the same
GPU").
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from megatron_workers.sync_plan import Copy
from recipe.config_schema import ConfigError, PPOConfig

logger = logging.getLogger(__name__)

TRAINER, ROLLOUT = "trainer", "rollout"  # the pools
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
NCCL_SHARED_GPU = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}  # hybrid: NCCL groups with two processes on one GPU
_POOL_KEYS = {TRAINER: ("trainer.nnodes", "trainer.n_gpus_per_node"),
              ROLLOUT: ("rollout.nnodes", "rollout.n_gpus_per_node")}


@dataclass(frozen=True)
class Bundle:
    """One GPU's bundle: `gpu` is its index in the node's placement group and the node-local GPU id."""

    pool: str  # TRAINER or ROLLOUT
    node: int  # node index within the pool (one placement group per node)
    gpu: int


@dataclass(frozen=True)
class Pool:
    """`nnodes` x `gpus_per_node` bundles; `occupants` processes share each bundle."""

    nnodes: int
    gpus_per_node: int
    occupants: int

    @property
    def size(self) -> int:
        return self.nnodes * self.gpus_per_node


@dataclass(frozen=True)
class EnginePlacement:
    """Where engine `i` runs: the actor on its first GPU's bundle, SGLang on `tp` GPUs from `base_gpu_id`."""

    bundle: Bundle
    tp: int

    @property
    def base_gpu_id(self) -> int:
        return self.bundle.gpu


@dataclass(frozen=True)
class PlacementPlan:
    """Which bundle every Megatron rank and every engine gets (see the module docstring)."""

    hybrid: bool
    pools: dict[str, Pool]
    roles: tuple[str, ...]  # Megatron roles, each `world_size` ranks on the trainer pool
    world_size: int
    engines: tuple[EnginePlacement, ...]
    tp: int = 1  # the actor's TP and PP sizes (the engines get its weights); ranks are TP fastest, then DP, then PP
    pp: int = 1

    def rank_bundle(self, rank: int) -> Bundle:
        """The bundle of global Megatron rank `rank` (the same for every role)."""
        g = self.pools[TRAINER].gpus_per_node
        return Bundle(TRAINER, rank // g, rank % g)

    @property
    def tensor_copies(self) -> tuple[Copy, ...] | None:
        """Hybrid: who fills and who serializes each engine TP rank's copy of each pipeline stage (see the module
        docstring); separate: None."""
        if not self.hybrid:
            return None
        g = self.pools[TRAINER].gpus_per_node
        per_stage = self.world_size // self.pp  # ranks of one pipeline stage: tp x dp

        def filler(gpu: int, stage: int) -> int:  # `gpu`: a global GPU index = the rank placed on it
            replica = stage * per_stage + gpu % per_stage  # stage's rank in gpu's DP replica, same TP position
            same_tp = [k for k in range(stage * per_stage, (stage + 1) * per_stage) if k % self.tp == gpu % self.tp]
            return min(same_tp, key=lambda k: (k // g != gpu // g, abs(k - replica)))

        return tuple(Copy(i, r, s, filler(gpu, s), gpu) for i, e in enumerate(self.engines) for r in range(e.tp)
                     for gpu in [e.bundle.node * g + e.base_gpu_id + r] for s in range(self.pp))

    def describe(self) -> str:
        pools = ", ".join(f"{name} {p.nnodes}x{p.gpus_per_node} ({p.occupants} per GPU)" for name, p in self.pools.items())
        engines = f"{len(self.engines)} engine(s) at TP {self.engines[0].tp}" if self.engines else "no engines"
        return (f"{'hybrid' if self.hybrid else 'separate'}: {pools}; Megatron {'/'.join(self.roles)} x "
                f"{self.world_size} ranks; {engines}")


def plan_placement(cfg: PPOConfig) -> PlacementPlan:
    """The placement of a validated config; raises ConfigError naming the key when it cannot fit."""
    t, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
    tp = rollout.tensor_model_parallel_size
    roles = tuple(cfg.workers())
    hybrid = cfg.actor_rollout_ref.hybrid_engine
    pools = {TRAINER: Pool(t.nnodes, t.n_gpus_per_node, len(roles) + (1 if hybrid else 0))}  # + the engine
    if not hybrid:
        r = cfg.rollout
        if r.nnodes is None or r.n_gpus_per_node is None:
            raise ConfigError("actor_rollout_ref.hybrid_engine=false puts the engines on their own GPUs, but "
                              "rollout.nnodes / rollout.n_gpus_per_node are not set; set both (e.g. rollout.nnodes=1 "
                              "rollout.n_gpus_per_node=8), or use actor_rollout_ref.hybrid_engine=true")
        pools[ROLLOUT] = Pool(r.nnodes, r.n_gpus_per_node, 1)
        if rollout.update_weights_mode == "tensor":
            raise ConfigError("actor_rollout_ref.rollout.update_weights_mode=tensor hands tensors over on the GPUs the "
                              "engines share with the trainer, but actor_rollout_ref.hybrid_engine=false gives them "
                              "GPUs of their own; use update_weights_mode=distributed (or disk, or null)")
    engine_pool = TRAINER if hybrid else ROLLOUT
    pool = pools[engine_pool]
    gpus_key = _POOL_KEYS[engine_pool][1]
    if pool.gpus_per_node % tp:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide {gpus_key}="
            f"{pool.gpus_per_node}: an engine's GPUs must lie on one node; choose an engine TP size that "
            f"divides {pool.gpus_per_node}")
    engines = tuple(EnginePlacement(Bundle(engine_pool, node, k * tp), tp)
                    for node in range(pool.nnodes) for k in range(pool.gpus_per_node // tp))
    world = pools[TRAINER].size
    m = cfg.actor_rollout_ref.actor.megatron
    plan = PlacementPlan(hybrid, pools, roles, world, engines, m.tensor_model_parallel_size,
                         m.pipeline_model_parallel_size)
    logger.info("placement: %s", plan.describe())
    return plan


def plan_trainer_only(nnodes: int, n_gpus_per_node: int) -> PlacementPlan:
    """Megatron actor ranks on `nnodes` x `n_gpus_per_node` bundles, one per bundle, and no engines (the SFT entry)."""
    plan = PlacementPlan(False, {TRAINER: Pool(nnodes, n_gpus_per_node, 1)}, ("actor",), nnodes * n_gpus_per_node, ())
    logger.info("placement: %s", plan.describe())
    return plan


class Placement:
    """A plan made real on the Ray cluster this process has joined (`ray.init` first).

    Creates one STRICT_PACK placement group per pool node and waits until all are ready, or
    removes them and raises naming the keys. `rank_options(role)` / `engine_options(i)` are the
    Ray actor options (plain data) that put each process on its bundle with its share.
    """

    def __init__(self, plan: PlacementPlan, *, ready_timeout_s: float = 60.0) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.plan = plan
        total = ray.cluster_resources()
        self.use_gpus = total.get("GPU", 0) > 0
        self._check_cluster(ray.nodes())
        bundles = sum(p.size for p in plan.pools.values())
        # Each bundle gets an equal part of at most half the cluster's CPUs (the rest stays free
        # for the driver's tasks, Ray's own helpers and the engines' subprocesses), at most 1.
        self.cpus_per_bundle = min(1.0, _floor4(total.get("CPU", 0) / (2 * bundles)))
        if self.cpus_per_bundle <= 0:
            raise RuntimeError(f"the Ray cluster has {total.get('CPU', 0):g} CPUs for {bundles} bundles; "
                               "give Ray more CPUs (ray_init.num_cpus, or `ray start --num-cpus`)")
        bundle = {"CPU": self.cpus_per_bundle, **({"GPU": 1} if self.use_gpus else {})}
        self.groups = {
            name: [placement_group([dict(bundle) for _ in range(p.gpus_per_node)], strategy="STRICT_PACK",
                                   name=f"polyturn-{name}-node{n}") for n in range(p.nnodes)]
            for name, p in plan.pools.items()
        }
        pgs = [pg for groups in self.groups.values() for pg in groups]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=ready_timeout_s)
        if len(ready) < len(pgs):
            self.shutdown()
            keys = " / ".join(k for name in plan.pools for k in _POOL_KEYS[name])
            raise RuntimeError(
                f"placement groups of {bundle} per GPU were not ready after {ready_timeout_s:.0f}s ({plan.describe()}): "
                f"the Ray cluster {dict(total)} cannot hold them; reduce {keys} or add nodes")
        logger.info("placement groups ready: %d bundle(s) of %s", bundles, bundle)

    def _check_cluster(self, nodes: list[dict[str, Any]]) -> None:
        """With GPUs, every pool node needs a Ray node with that many GPUs (refused before any group waits)."""
        if not self.use_gpus:
            return
        free = sorted((n["Resources"].get("GPU", 0) for n in nodes if n.get("Alive")), reverse=True)
        needed = sorted((p.gpus_per_node for p in self.plan.pools.values() for _ in range(p.nnodes)), reverse=True)
        for i, gpus in enumerate(needed):
            if i >= len(free) or free[i] < gpus:
                keys = ", ".join(k for name in self.plan.pools for k in _POOL_KEYS[name])
                raise RuntimeError(
                    f"the plan needs nodes with {needed} GPUs but the Ray cluster's nodes have {free}; "
                    f"adjust {keys} to the cluster, or join more nodes (ray start --address=...)")

    def _options(self, bundle: Bundle) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        occupants = self.plan.pools[bundle.pool].occupants
        opts: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[bundle.pool][bundle.node], placement_group_bundle_index=bundle.gpu),
            "num_cpus": _floor4(self.cpus_per_bundle / occupants),
        }
        if self.use_gpus:
            opts["num_gpus"] = _floor4(1 / occupants)
            if self.plan.hybrid:
                opts["runtime_env"] = {"env_vars": dict(NCCL_SHARED_GPU)}
        return opts

    def rank_options(self, role: str) -> list[dict[str, Any]]:
        """Ray options for each global rank of Megatron role `role` (actor / ref / critic)."""
        if role not in self.plan.roles:
            raise ValueError(f"role {role!r} is not in this plan ({self.plan.roles})")
        return [self._options(self.plan.rank_bundle(r)) for r in range(self.plan.world_size)]

    def engine_options(self, i: int) -> dict[str, Any]:
        """Ray options for engine `i`'s actor (its SGLang `base_gpu_id` is `plan.engines[i].base_gpu_id`)."""
        opts = self._options(self.plan.engines[i].bundle)
        if self.use_gpus:  # SGLang picks its tp GPUs from base_gpu_id among all of the node's GPUs
            env = opts.get("runtime_env", {}).get("env_vars", {})
            opts["runtime_env"] = {"env_vars": {**env, NOSET_CUDA_VISIBLE_DEVICES: "1"}}
        return opts

    def check_ranks(self, role: str, gpu_ids: list[tuple[int, ...]]) -> None:
        """Refuse to go on when Ray gave rank r a GPU other than the plan's (engines would then share the wrong GPUs)."""
        if not self.use_gpus:
            return
        for r, ids in enumerate(gpu_ids):
            want = self.plan.rank_bundle(r).gpu
            if tuple(ids) != (want,):
                raise RuntimeError(
                    f"{role} rank {r} runs on GPU {ids}, the plan put it on GPU {want}: another placement group "
                    "holds some of this node's GPUs; start polyturn on nodes nothing else reserves GPUs on")

    def shutdown(self) -> None:
        """Remove the placement groups."""
        from ray.util.placement_group import remove_placement_group

        for groups in self.groups.values():
            for pg in groups:
                remove_placement_group(pg)


def _floor4(x: float) -> float:
    """Ray accounts resources in units of 1e-4: round shares down so that they add up to at most 1."""
    return math.floor(x * 10_000) / 10_000
