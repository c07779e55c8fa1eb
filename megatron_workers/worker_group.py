"""A TP x PP x DP group of Ray actors, one per Megatron rank, and batch dispatch over it.

`MegatronWorkerGroup` starts one `RankWorker` Ray actor per rank with the Ray options the caller
gives it (a run's come from `recipe.placement`: the rank's placement-group bundle and its GPU /
CPU share; the group itself reserves nothing), lets rank 0 choose the rendezvous address, and
initialises
torch.distributed (NCCL with GPUs, gloo without) plus Megatron's parallel state through
`megatron_workers.parallel` in every actor. Each actor then builds a *role* object (the
actor, reference or critic of `actor.py` / `critic.py`) from a picklable factory, and the
group calls the role's methods:

- `call_all(method, ...)`: the same arguments to every rank, every rank's result back;
- `dispatch(method, batch, mini_batches=None, ...)`: the batch (a dict of `(B, ...)`
  tensors) is split along dim 0 into DP shards; every TP/PP rank of DP rank `d` receives shard `d`; the results of
  the *collector* ranks (last pipeline stage, TP rank 0: the ones holding complete outputs)
  come back in DP order.

Where it departs from verl's single-controller dispatch: the split can be *mini-batch
aware* (`mini_batches`): each mini-batch is split across DP ranks separately, so global
mini-batch `i` holds the same samples for any DP size, and parallelism does not change
which samples share an optimizer step.

Faults: every call waits on the ranks as they finish and stops at the first failure: a rank that
died (its actor is gone) or raised (a collective past the process-group timeout,
`collective_timeout_s`, raises on every rank waiting in it; a peer's death breaks the others'
collectives at once) ends the call with `RankFailure`, naming the group's role, the rank and its
(tp, pp, dp) coordinates; a dead rank is named before the peers it left waiting.

Each call's Ray task is named `<role>.rank<r>.<method>` (`actor.rank1.update_policy`): the rank's process title
while it runs (`ps`, `top`, py-spy) and its name in Ray's task list and timeline.

Megatron numbers ranks `tp-cp-ep-dp-pp` (TP fastest); the group asks every actor for its
(tp, pp, dp) coordinates after initialisation instead of recomputing that order.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import ray
import torch

from megatron_workers import cpu_compat
from megatron_workers.ports import free_port
from megatron_workers.sync_plan import GroupAddress, SyncPlan

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parent.parent
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is split: `tp` x `pp` ranks hold one replica, `dp` replicas in all."""

    tp: int = 1  # tensor-parallel size (splits heads, MLP width, vocabulary)
    pp: int = 1  # pipeline-parallel size (splits layers into stages)
    dp: int = 1  # data-parallel size (replicas, each gets a slice of the batch)
    vpp: int = 1  # virtual pipeline stages: model chunks per pipeline rank (Megatron's interleaved schedule)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class RankInfo:
    """One actor's place in the layout, as Megatron's parallel state reports it."""

    rank: int  # global torch.distributed rank
    tp_rank: int
    pp_rank: int
    dp_rank: int
    is_collector: bool  # last pipeline stage and TP rank 0: its outputs are the group's outputs
    node_id: str  # the Ray node this rank runs on
    gpu_ids: tuple[int, ...]  # the GPU ids Ray assigned to this rank (empty without GPUs)


class RankWorker:
    """Body of one Ray actor: one Megatron rank, hosting one role object."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.role: Any = None
        self.backend = cpu_compat.apply_cpu_compat()  # this process's start: the CPU adapter, once

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the rendezvous."""
        return ray.util.get_node_ip_address(), free_port("")

    def init_distributed(self, master_addr: str, master_port: int, tp: int, pp: int, vpp: int, seed: int,
                         timeout_s: float = 1800.0) -> RankInfo:
        """Initialise torch.distributed (collectives time out after `timeout_s`) and Megatron's parallel state;
        report coordinates."""
        from megatron.core import parallel_state as mpu

        from megatron_workers import parallel

        parallel.init_distributed(
            self.rank, self.world_size, master_addr, master_port, tp, pp, backend=self.backend, vpp=vpp, seed=seed,
            timeout_minutes=timeout_s / 60,
        )
        return RankInfo(
            rank=self.rank,
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            dp_rank=mpu.get_data_parallel_rank(),
            is_collector=mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0,
            node_id=ray.get_runtime_context().get_node_id(),
            gpu_ids=tuple(int(i) for i in ray.get_gpu_ids()),
        )

    def build_role(self, factory: Callable[[], Any]) -> None:
        """Build this rank's role object (actor / reference / critic) by calling `factory()`."""
        self.role = factory()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`self.role.method(*args, **kwargs)`; refuses before `build_role`."""
        if self.role is None:
            raise RuntimeError(f"rank {self.rank}: call {method!r} before build_role()")
        return getattr(self.role, method)(*args, **kwargs)

    def shutdown(self) -> None:
        """Drop the role and tear down this rank's process groups."""
        from megatron_workers import parallel

        self.role = None
        parallel.destroy()


def is_collective_error(e: BaseException) -> bool:
    """A torch.distributed failure (timeout, broken peer): NCCL's DistError, gloo's RuntimeError from its sources."""
    return isinstance(e, torch.distributed.DistError) or (isinstance(e, RuntimeError) and "third_party/gloo" in str(e))


class RankFailure(RuntimeError):
    """A Megatron rank died, or a call on it failed (e.g. a collective past its timeout); the message names the
    role, the rank and what happened."""


def split_batch(batch: Batch, dp: int, num_mini_batches: int = 1) -> list[Batch]:
    """Split `batch` into `dp` shards; mini-batch aware.

    The batch is cut into `num_mini_batches` contiguous mini-batches and each mini-batch into
    `dp` contiguous pieces; shard `d` is the concatenation of piece `d` of every mini-batch.
    So a rank's local mini-batch `i` is part of global mini-batch `i` whatever `dp` is.
    """
    sizes = {k: v.shape[0] for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on the batch dimension (dim 0): {sizes}")
    n = next(iter(sizes.values()))
    if n % (dp * num_mini_batches) != 0:
        raise ValueError(
            f"batch of {n} samples cannot be split into {num_mini_batches} mini-batch(es) x "
            f"{dp} data-parallel ranks; make the batch size a multiple of {dp * num_mini_batches}"
        )
    mini, piece = n // num_mini_batches, n // (num_mini_batches * dp)
    shards = []
    for d in range(dp):
        idx = torch.cat(
            [torch.arange(i * mini + d * piece, i * mini + (d + 1) * piece) for i in range(num_mini_batches)]
        )
        shards.append({k: v.index_select(0, idx) for k, v in batch.items()})
    return shards


def concat_results(results: list[Batch]) -> Batch:
    """Concatenate per-DP-rank tensor dicts (from a contiguous split) back into one batch."""
    return {k: torch.cat([r[k] for r in results], dim=0) for k in results[0]}


class MegatronWorkerGroup:
    """TP x PP x DP Ray actors running Megatron-Core, driven from the caller's process.

    `ray.init` must have been called. `rank_options[r]` are rank r's Ray actor options
    (`scheduling_strategy`, `num_cpus`, `num_gpus`, `runtime_env`), e.g. from
    `recipe.placement.Placement.rank_options`; the group adds the repository (and the CPU import
    stand-ins when active) to each rank's PYTHONPATH. Without `rank_options` (tests, benchmarks)
    every rank is an unplaced actor with `UNPLACED_RANK_OPTIONS`. The layout is checked against
    `hf_config` (when given, through `parallel.validate_layout`) before any actor starts.
    """

    UNPLACED_RANK_OPTIONS: dict[str, Any] = {"num_cpus": 0.25}

    def __init__(
        self,
        layout: ParallelLayout,
        rank_options: Optional[Sequence[dict[str, Any]]] = None,
        *,
        hf_config: Any = None,
        seed: int = 0,
        env_vars: Optional[dict[str, str]] = None,
        ready_timeout_s: float = 120.0,
        name: str = "megatron",
        collective_timeout_s: float = 1800.0,
    ) -> None:
        """`name`: the role the group plays (actor, ref, critic), named in its errors; `collective_timeout_s`: the
        ranks' torch.distributed timeout (trainer.collective_timeout_s)."""
        if not ray.is_initialized():
            raise RuntimeError("ray is not initialised: call ray.init(...) before MegatronWorkerGroup")
        self.layout = layout
        self.name = name
        self.ranks: list[RankInfo] = []
        if hf_config is not None:
            from megatron_workers.parallel import validate_layout

            validate_layout(hf_config, layout.tp, layout.pp, layout.vpp)
        if rank_options is None:
            rank_options = [dict(self.UNPLACED_RANK_OPTIONS) for _ in range(layout.world_size)]
        if len(rank_options) != layout.world_size:
            raise ValueError(f"{len(rank_options)} rank_options for a layout of {layout.world_size} ranks ({layout})")

        env = {  # the driver's PYTHONPATH: the CPU import stand-ins when its start applied the adapter
            "PYTHONPATH": os.pathsep.join(p for p in [str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")] if p),
            **(env_vars or {}),
        }
        remote_cls = ray.remote(RankWorker)
        self._workers = []
        for i, opts in enumerate(rank_options):
            runtime_env = dict(opts.get("runtime_env") or {})
            runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
            self._workers.append(remote_cls.options(**{**opts, "runtime_env": runtime_env}).remote(i, layout.world_size))
        # Every rank started before the rendezvous, which must finish within collective_timeout_s.
        ready = [w.rendezvous_address.remote() for w in self._workers]
        _, waiting = ray.wait(ready, num_returns=len(ready), timeout=ready_timeout_s)
        if waiting:
            self._kill()
            r = ready.index(waiting[0])
            raise RuntimeError(
                f"Megatron rank {r} did not start within {ready_timeout_s:.0f}s: the Ray cluster cannot place it "
                f"with {rank_options[r]}; place the ranks with recipe.placement, or free resources")
        addr, port = ray.get(ready[0])
        self.ranks = self._get(
            [w.init_distributed.remote(addr, port, layout.tp, layout.pp, layout.vpp, seed, collective_timeout_s)
             for w in self._workers], "init_distributed")
        logger.info("started %d Megatron ranks (%s) at %s:%d", layout.world_size, layout, addr, port)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def build(self, factory: Callable[[], Any]) -> None:
        """Build the role object on every rank: `factory` is pickled to each actor and called there."""
        self._get([w.build_role.remote(factory) for w in self._workers], "build_role")

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `role.method(*args, **kwargs)` on every rank; results in rank order."""
        return self._get([self._call(r, method, *args, **kwargs) for r in range(self.world_size)], method)

    def dispatch(self, method: str, batch: Batch, *, mini_batches: Optional[int] = None, **kwargs: Any) -> list[Any]:
        """Split `batch` over DP ranks, call `role.method(shard, **kwargs)` everywhere.

        With `mini_batches=n` the split is mini-batch aware (see `split_batch`) and
        `num_mini_batches=n` is passed to the method as well, so caller and ranks cannot
        disagree on it. Returns the collector ranks' results (last PP stage, TP rank 0), one
        per DP rank, in DP order.
        """
        if mini_batches is not None:
            kwargs["num_mini_batches"] = mini_batches
        shards = [ray.put(s) for s in split_batch(batch, self.layout.dp, mini_batches or 1)]
        futures = [self._call(info.rank, method, shards[info.dp_rank], **kwargs) for info in self.ranks]
        results = self._get(futures, method)
        by_dp = {info.dp_rank: r for info, r in zip(self.ranks, results) if info.is_collector}
        return [by_dp[d] for d in range(self.layout.dp)]

    # -- weight sync: the actor role's sender (`MegatronActor`), driven by recipe.weight_sync -----------------------

    def send_weights(self, plan: SyncPlan) -> list[Optional[dict[str, Any]]]:
        """Every rank streams its stage's weights under `plan`; each rank's metrics (None where it shipped nothing)."""
        return self.call_all("send_weights", plan)

    def export_hf(self, path: str) -> None:
        """Write the model as an HF checkpoint to `path` (a collective; rank 0 writes)."""
        self.call_all("export_hf", path)

    def weight_sync_endpoints(self) -> list[GroupAddress]:
        """Distributed path: one address per pipeline stage, where its sender can host the stage's group."""
        return [a for a in self.call_all("weight_sync_endpoint") if a is not None]

    def init_weight_sync_groups(self, groups: dict[int, GroupAddress]) -> None:
        """Distributed path: each stage's sender hosts `groups[stage]` (returns once every engine rank joined)."""
        self.call_all("init_weight_sync_groups", groups)

    def destroy_weight_sync_groups(self) -> None:
        self.call_all("destroy_weight_sync_groups")

    def _call(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Submit `role.method(*args, **kwargs)` to `rank` as the Ray task `<role>.rank<r>.<method>`."""
        return self._workers[rank].call.options(name=f"{self.name}.rank{rank}.{method}").remote(method, *args, **kwargs)

    def _get(self, refs: list[Any], method: str) -> list[Any]:
        """Every rank's result of `method` (refs in rank order); RankFailure at the first rank that failed."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception:  # noqa: BLE001 - named below, with the rank that failed
                # A peer's death breaks the others' collectives at once: give them a moment to report, then
                # name a dead rank before the ranks it left waiting.
                ray.wait(pending, num_returns=len(pending), timeout=5.0)
                failures = []
                for rank, ref in enumerate(refs):
                    try:
                        ray.get(ref, timeout=0)
                    except ray.exceptions.GetTimeoutError:
                        continue
                    except Exception as e:  # noqa: BLE001
                        failures.append((not isinstance(e, ray.exceptions.RayActorError), rank, e))
                _, rank, error = min(failures, key=lambda f: (f[0], f[1]))
                cause = getattr(error, "cause", None) or error
                if isinstance(error, ray.exceptions.RayActorError):
                    raise RankFailure(f"{self._where(rank)} died during {method} ({type(error).__name__}); rerun "
                                      "the same command to resume from the last checkpoint") from None
                if is_collective_error(cause):
                    first_line = (str(cause).strip().splitlines() or [""])[0][:300]
                    raise RankFailure(f"{self._where(rank)} failed in {method}: {type(cause).__name__}: {first_line} "
                                      "(a collective past trainer.collective_timeout_s, or a peer rank that died)"
                                      ) from error
                raise error  # the role's own error (its type kept by Ray), not a fault of the group
        return ray.get(refs)

    def _where(self, rank: int) -> str:
        where = f"Megatron {self.name} rank {rank}"
        if rank < len(self.ranks):
            info = self.ranks[rank]
            where += f" (tp {info.tp_rank}, pp {info.pp_rank}, dp {info.dp_rank})"
        return where

    def shutdown(self) -> None:
        """Tear down process groups and kill the actors (their placement groups are the caller's)."""
        try:
            ray.get([w.shutdown.remote() for w in self._workers], timeout=30)
        except Exception as e:  # noqa: BLE001 - a dead actor cannot tear down; killing it below is enough
            logger.warning("some Megatron %s ranks did not shut down cleanly (%s); killing them", self.name,
                           type(e).__name__)
        self._kill()

    def _kill(self) -> None:
        for w in self._workers:
            ray.kill(w)
