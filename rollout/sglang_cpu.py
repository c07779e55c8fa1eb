"""The only place that adapts SGLang to a CPU-only machine.

`engine_kwargs_for_this_machine` is an engine process's one adapter call: `SGLangEngine` makes it as it
starts, before it imports SGLang (in an engine actor, from the actor's `__init__`). On a GPU machine
it returns the caller's kwargs unchanged. Without a GPU it puts the `cpu_standins` import stand-ins on the path (SGLang's subprocesses inherit them
through PYTHONPATH), selects SGLang's own CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `device="cpu"`,
`attention_backend="torch_native"`), and bounds the KV cache: with default sizing the CPU engine
reserves ~15 GB, so `max_total_tokens` always gets a value. At `tp_size > 1` the TP ranks' OpenMP
threads are bound to disjoint cores (`SGLANG_CPU_OMP_THREADS_BIND`, "0|1" on two cores) and SGLang's
NCCL library path points at a file that does not exist, so no rank tries to load NCCL.
With `enable_deterministic_inference` (per-request sampling seeds, `rollout.deterministic`), `torch_native` is
admitted as a deterministic attention backend, and `sglang_plugin` (SGLang's general plug-in hook, declared in
pyproject.toml) gives the scheduler what SGLang's deterministic mode lacks on CPU: the seeded sampler's hash op
and a batch-invariant mode in place of SGLang's Triton kernels.
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

#: Set for SGLang's subprocesses when this module adapted the engine to CPU; `sglang_plugin` acts only then.
CPU_ENGINE_ENV = "POLYTURN_SGLANG_CPU"

#: How the weight sync's tensor path pickles a host-memory tensor (`megatron_workers.shared_tensors.serialize`): by the name
#: of its shared-memory buffer, which the engine maps once and keeps. The schedulers' safe unpickler must admit it.
HOST_TENSOR_REBUILD = ("megatron_workers.shared_tensors", "rebuild_shared_view")

_CPU_FIXED = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True}


def engine_kwargs_for_this_machine(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return `sglang.Engine` kwargs adapted to this machine (a copy; the input is not changed)."""
    kwargs = dict(engine_kwargs)
    if not cpu_standins.activate():
        return kwargs
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ[CPU_ENGINE_ENV] = "1"
    # torch's own switch: host allocations of 2 MB and more on transparent huge pages, in the scheduler (spawned
    # after this). Every weight-sync bucket the engine receives is a fresh allocation; 4x faster to first touch.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    for key, value in _CPU_FIXED.items():
        if key in kwargs and kwargs[key] != value:
            logger.warning("sglang %s=%r is not available on CPU; using %r", key, kwargs[key], value)
        kwargs[key] = value
    tp = int(kwargs.get("tp_size", 1))
    if tp > 1:
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", _cores_per_rank(tp))
        os.environ.setdefault("SGLANG_NCCL_SO_PATH", _NO_NCCL)
    if kwargs.get("enable_deterministic_inference"):
        from sglang.srt.arg_groups.choices import add_deterministic_attention_backend_choices

        add_deterministic_attention_backend_choices(["torch_native"])  # per-request attention: batch-invariant
    if kwargs.get("max_total_tokens") is None:
        kwargs["max_total_tokens"] = CPU_DEFAULT_MAX_TOTAL_TOKENS
    logger.info("SGLang on CPU: torch_native attention, max_total_tokens=%d", kwargs["max_total_tokens"])
    return kwargs


def sglang_plugin() -> None:
    """SGLang general plug-in (entry point group `sglang.srt.plugins`), run by SGLang in each of its processes.

    Acts only in an engine this module adapted to CPU: it defines the hash op of SGLang's seeded sampling,
    replaces SGLang's batch-invariant mode (Triton kernels, CUDA / XPU only) with `_cpu_batch_invariant_mode`, and
    lets the scheduler's safe unpickler rebuild the weight sync's host tensors (`HOST_TENSOR_REBUILD`).
    tests/test_deterministic_rollout.py checks that a request's tokens and log-probs then do not depend on the
    batch it shares.
    """
    if os.environ.get(CPU_ENGINE_ENV) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils.common import SafeUnpickler

    SafeUnpickler.ALLOWED_GLOBALS.add(HOST_TENSOR_REBUILD)

    _define_murmur_hash32_cpu()
    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.maybe_enable_batch_invariant_mode",
                          _cpu_batch_invariant_mode, HookType.REPLACE)


_MASK32 = 0xFFFFFFFF


def _define_murmur_hash32_cpu() -> None:
    """Register `sgl_kernel::murmur_hash32_cpu`, the CPU op behind SGLang's seeded sampling.

    sgl-kernel's CPU build provides it; PyPI has only the CUDA build, so here it is written in torch. It is
    the MurmurHash3 (x86, 32-bit) of the four 32-bit words (seed low, seed high, position, column) that
    SGLang's Triton kernel `murmur_hash32_kernel` hashes on GPUs.
    """
    import torch

    if hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return

    @torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=(), device_types="cpu",
                             schema="(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    def murmur_hash32_cpu(seed, positions, col_indices):  # [n] uint64, [n], [m] -> [n, m] uint32
        s = seed.view(torch.int64).unsqueeze(1)  # [n, 1]; uint64 reinterpreted, bits unchanged
        h = torch.zeros((seed.shape[0], col_indices.shape[0]), dtype=torch.int64)  # [n, m]
        for word in (s & _MASK32, (s >> 32) & _MASK32, positions.to(torch.int64).unsqueeze(1) & _MASK32,
                     col_indices.to(torch.int64).unsqueeze(0) & _MASK32):
            h = _murmur3_mix(h, word)
        h = h ^ 16
        for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            h = _mul32(h ^ (h >> shift), mult)
        return (h ^ (h >> 16)).to(torch.uint32)

    @murmur_hash32_cpu.register_fake
    def _(seed, positions, col_indices):
        return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2**32 for int64 tensors x < 2**32, in two halves so no product overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: Any, r: int) -> Any:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _murmur3_mix(h: Any, k: Any) -> Any:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    return (_mul32(_rotl32(h ^ k, 13), 5) + 0xE6546B64) & _MASK32


def _cpu_batch_invariant_mode(model_runner: Any) -> None:
    """The CPU counterpart of SGLang's batch-invariant mode, installed instead of its Triton kernels.

    On CPU, MKL computes a row of a matrix product differently for different numbers of rows (a lone row
    goes through a matrix-vector kernel), so a request's logits would depend on the requests batched with
    it. Here `mm` and `addmm` compute each row on its own, with the matrix-vector kernels (`mv`, `addmv`).
    Attention (torch_native) already runs per request; norms and softmax reduce each row on its own.
    """
    import torch
    from sglang.srt.runtime_context import get_exec

    if not get_exec().deterministic.enable_deterministic_inference:
        return
    global _BATCH_INVARIANT_LIB
    if _BATCH_INVARIANT_LIB is not None:
        return
    _BATCH_INVARIANT_LIB = torch.library.Library("aten", "IMPL")
    _BATCH_INVARIANT_LIB.impl("aten::mm", _mm_by_rows, "CPU")
    _BATCH_INVARIANT_LIB.impl("aten::addmm", _addmm_by_rows, "CPU")
    logger.info("SGLang on CPU: deterministic inference, matrix products computed row by row")


_BATCH_INVARIANT_LIB = None  # the torch.library registration of _cpu_batch_invariant_mode, once per process


def _mm_by_rows(a: Any, b: Any) -> Any:  # a [M, K] @ b [K, N] -> [M, N]
    import torch

    bt = b.t()  # [N, K]
    return torch.stack([torch.mv(bt, row) for row in a]) if a.shape[0] else a.new_empty((0, b.shape[1]))


def _addmm_by_rows(bias: Any, a: Any, b: Any, *, beta: float = 1, alpha: float = 1) -> Any:  # -> [M, N]
    import torch

    bt = b.t()  # [N, K]
    bias = bias.expand(a.shape[0], b.shape[1])  # [M, N]
    if not a.shape[0]:
        return bias.clone()
    return torch.stack([torch.addmv(bias[i], bt, row, beta=beta, alpha=alpha) for i, row in enumerate(a)])


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
