"""The only place that adapts SGLang to a CPU-only machine.

On a GPU machine `engine_kwargs_for_this_machine` returns the caller's kwargs unchanged. Without a
GPU it puts the `cpu_standins` import stand-ins on the path (SGLang's subprocesses inherit them
through PYTHONPATH), selects SGLang's own CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `device="cpu"`,
`attention_backend="torch_native"`), and bounds the KV cache: with default sizing the CPU engine
reserves ~15 GB, so `max_total_tokens` always gets a value. At `tp_size > 1` the TP ranks' OpenMP
threads are bound to disjoint cores (`SGLANG_CPU_OMP_THREADS_BIND`, "0|1" on two cores) and SGLang's
NCCL library path points at a file that does not exist, so no rank tries to load NCCL.
`skips_memory_release` tells the engine client that memory release / resume must be skipped:
the CPU engine has no device memory to give back, and SGLang's release path calls
`torch.cuda.synchronize()`, which kills the scheduler without a GPU.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import cpu_standins

logger = logging.getLogger(__name__)

#: KV-cache size (tokens) used on CPU when the caller did not choose one.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384

_NO_NCCL = "/nonexistent/polyturn-cpu-has-no-libnccl.so"  # must not exist: SGLang then skips NCCL

_CPU_FIXED = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True}


def engine_kwargs_for_this_machine(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return `sglang.Engine` kwargs adapted to this machine (a copy; the input is not changed)."""
    kwargs = dict(engine_kwargs)
    if not cpu_standins.activate():
        return kwargs
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    for key, value in _CPU_FIXED.items():
        if key in kwargs and kwargs[key] != value:
            logger.warning("sglang %s=%r is not available on CPU; using %r", key, kwargs[key], value)
        kwargs[key] = value
    tp = int(kwargs.get("tp_size", 1))
    if tp > 1:
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", _cores_per_rank(tp))
        os.environ.setdefault("SGLANG_NCCL_SO_PATH", _NO_NCCL)
    if kwargs.get("max_total_tokens") is None:
        kwargs["max_total_tokens"] = CPU_DEFAULT_MAX_TOTAL_TOKENS
    logger.info("SGLang on CPU: torch_native attention, max_total_tokens=%d", kwargs["max_total_tokens"])
    return kwargs


def _cores_per_rank(tp: int) -> str:
    """This process's cores split into `tp` contiguous groups, SGLang's "0-3|4-7" format."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"rollout tensor_model_parallel_size={tp} needs at least {tp} CPU cores, "
                         f"this process may use {len(cores)}; lower it or set SGLANG_CPU_OMP_THREADS_BIND")
    per = len(cores) // tp
    groups = [cores[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def skips_memory_release() -> bool:
    """True where `release_memory_occupation` / `resume_memory_occupation` must not reach SGLang (no GPU)."""
    return not cpu_standins.gpu_present()
