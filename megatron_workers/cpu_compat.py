"""The only place that adapts Megatron-Core to a CPU-only machine (gloo instead of NCCL).

Megatron-Core is written for CUDA; on a machine without a GPU a handful of its assumptions
break. `apply_cpu_compat()` patches exactly those, and nothing else in polyturn knows it may be
running on a CPU. Every process that runs Megatron code calls it once, at its start (the Megatron
rank actor, `check_parity`'s main and its spawned ranks, the driver, benchmarks, the test
session), before importing megatron. Measured against megatron-core 0.19.2 and torch 2.14.1
(a CUDA build):

- The import stand-ins (`flash_mla` raising ImportError instead of OSError, `sgl_kernel`) are
  put on the import path (`cpu_standins.activate()`); importing megatron's GPT model before that
  fails, and `megatron_workers.model` says which call is missing.
- `torch.cuda.current_device()` is used as the device of every parameter, activation buffer and
  P2P shape tensor. It must answer `torch.device("cpu")` (answering 0 would mean `cuda:0`);
  polyturn's own code takes its device from it too.
- `Tensor.cuda()` moves tensors "to the GPU" in a few places on the common path (the tied
  embedding copy on the last pipeline stage, the optimizer's state loading); without a GPU it
  returns the tensor as it is (on a machine without a GPU it could only have raised).
- `torch.cuda.synchronize()` guards batched P2P ops in the pipeline schedule; on CPU there is
  nothing to wait for, so it becomes a no-op. `torch.cuda.current_stream()` (asked by the DDP
  grad buffer before every grad reduction since 0.19, to wait on CUDA-graph events that a CPU
  run never records) answers the CPU's stream, `torch.cpu.current_stream()`, whose waits do
  nothing. `torch.cuda.get_rng_state()` answers an empty
  state and `set_rng_state` ignores it (there is no CUDA generator to save or restore).
- Activation recompute (`recompute_granularity=full`): Megatron's `CheckpointFunction` saves and
  restores the CPU and CUDA RNG states around the recomputed forward through its own
  `_get_cuda_rng_state` / `_set_cuda_rng_state` (`torch.cuda.random`, not the names above). In
  `megatron.core.tensor_parallel.random` they answer an empty state and ignore one; the CPU
  generator, the only one that draws here, is saved and restored by Megatron itself.
- The pipeline schedules (token counters), the optimizer (`FP32Optimizer._scale`, overflow
  buffers), the grad-norm code in `clip_grads` and `megatron.core.utils` allocate tensors with
  `device="cuda"`; they are created on the CPU instead, only inside those modules, through a view
  of `torch` whose `zeros/ones/empty/full/tensor/arange` map a CUDA device to the CPU. The view
  is installed when each module is imported (an import hook), so the call itself stays cheap.
- `clip_grad_by_total_norm_fp32` asserts `torch.cuda.FloatTensor` grads; the optimizer gets a
  version with the same math (scale every grad by max_norm / (total_norm + 1e-6) when below 1)
  that accepts CPU grads.
- Megatron's distributed optimizer and its mixed-precision (bf16) optimizer sort the parameters
  they wrap by `param.type()`, accepting only the `torch.cuda.*Tensor` names (a CPU parameter is a
  TypeError). While `DistributedOptimizer` or `Float16OptimizerWithFloat16Params` is constructed
  (only then), `Tensor.type()` without arguments answers the CUDA name of a CPU tensor's type;
  their sharding, fp32 main params and gloo reduce-scatter / all-gather then run unchanged.
- polyturn's packed attention (`megatron_workers.attention`) defaults to PyTorch's varlen
  Flash-Attention, a CUDA kernel; its `KERNEL` becomes the per-segment `scaled_dot_product_attention`.

With a GPU present, `apply_cpu_compat()` changes nothing and answers "nccl".
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

import cpu_standins

logger = logging.getLogger(__name__)

_MARK = "_polyturn_cpu_compat"
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")
_OPTIMIZER_MODULE = "megatron.core.optimizer.optimizer"
_DISTRIB_OPTIMIZER_MODULE = "megatron.core.optimizer.distrib_optimizer"
_RNG_MODULE = "megatron.core.tensor_parallel.random"
_ATTENTION_MODULE = "megatron_workers.attention"
# Modules adapted as they are imported: those that create tensors with device="cuda" on the CPU-reachable path
# (megatron-core 0.19.2), and the distributed optimizer (its type checks).
_CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    _OPTIMIZER_MODULE,
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    _DISTRIB_OPTIMIZER_MODULE,
)
# Every module adapted as it is imported: the above, the RNG state helpers of activation recompute and
# polyturn's packed attention (its kernel).
_ADAPTED_MODULES = (*_CUDA_FACTORY_MODULES, _RNG_MODULE, _ATTENTION_MODULE)


def _cpu_device(*_args: Any, **_kwargs: Any) -> torch.device:
    return torch.device("cpu")


def _cpu_stream(*_args: Any, **_kwargs: Any) -> Any:
    return torch.cpu.current_stream()


def _no_sync(*_args: Any, **_kwargs: Any) -> None:
    return None


def _no_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)  # (0,) uint8: there is no CUDA generator


def _ignore_rng_state(*_args: Any, **_kwargs: Any) -> None:
    return None


def _tensor_stays(self: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
    return self


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a tensor factory so that a CUDA `device=` argument lands on the CPU."""

    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


def _clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                  use_decoupled_grad: bool = False) -> None:
    """Megatron's clip by total norm (same coefficient), without its CUDA-only assertion and kernel."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    grads = [getattr(p, attr).detach() for p in params if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _cuda_type_names(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap `DistributedOptimizer.__init__` so that, during it, `Tensor.type()` names a CPU tensor's
    type as its CUDA counterpart ("torch.FloatTensor" -> "torch.cuda.FloatTensor")."""
    tensor_type = torch.Tensor.type

    def cuda_named(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = tensor_type(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        torch.Tensor.type = cuda_named  # type: ignore[method-assign]
        try:
            init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = tensor_type  # type: ignore[method-assign]

    return wrapper


def _torch_view_on_cpu() -> types.ModuleType:
    """A module that forwards every attribute to `torch` but whose factories create CPU tensors."""
    view = types.ModuleType("torch", doc="torch, with CUDA-device tensor factories sent to the CPU")
    view.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[attr-defined]
    for name in _FACTORIES:
        setattr(view, name, _on_cpu(getattr(torch, name)))
    setattr(view, _MARK, True)
    return view


def _adapt_module(module: types.ModuleType) -> None:
    """Adapt one of `_ADAPTED_MODULES`: recompute's RNG state helpers, the packed attention's kernel, or a CPU
    view of torch (and the optimizer's clip, the optimizers' type checks)."""
    if module.__name__ == _ATTENTION_MODULE:
        module.KERNEL = module.segment_sdpa
        return
    if module.__name__ == _RNG_MODULE:
        module._get_cuda_rng_state = _no_rng_state
        module._set_cuda_rng_state = _ignore_rng_state
        return
    if not getattr(module.torch, _MARK, False):
        module.torch = _torch_view_on_cpu()
    if module.__name__ == _OPTIMIZER_MODULE:
        module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    wrapped = {_DISTRIB_OPTIMIZER_MODULE: "DistributedOptimizer", _OPTIMIZER_MODULE: "Float16OptimizerWithFloat16Params"}
    cls = getattr(module, wrapped.get(module.__name__, ""), None)
    if cls is not None and not getattr(cls.__init__, _MARK, False):
        init = _cuda_type_names(cls.__init__)
        setattr(init, _MARK, True)
        cls.__init__ = init


class _AdaptingLoader(importlib.abc.Loader):
    """Runs the real loader, then `_adapt_module` on the fresh module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _adapt_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


class _AdaptOnImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that adapts `_ADAPTED_MODULES` as they are imported."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in _ADAPTED_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _AdaptingLoader(spec.loader)
        return spec


def apply_cpu_compat() -> str:
    """Adapt Megatron-Core to CPU + gloo when no GPU is present; idempotent; call it at a process's
    start, before importing megatron.

    Returns the torch.distributed backend for this machine: "gloo" when the CPU adaptations are
    active (applied now or before), "nccl" with a GPU (then nothing is changed).
    """
    if not cpu_standins.activate():
        return "nccl"
    if getattr(torch.cuda.current_device, _MARK, False):
        return "gloo"
    current_device = _cpu_device
    setattr(current_device, _MARK, True)
    torch.cuda.current_device = current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _no_sync  # type: ignore[assignment]
    torch.cuda.current_stream = _cpu_stream  # type: ignore[assignment]
    torch.cuda.get_rng_state = _no_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = _ignore_rng_state  # type: ignore[assignment]
    torch.Tensor.cuda = _tensor_stays  # type: ignore[method-assign]
    for name in _ADAPTED_MODULES:
        if name in sys.modules:
            _adapt_module(sys.modules[name])
    sys.meta_path.insert(0, _AdaptOnImport())
    logger.info("megatron-core adapted to CPU + gloo (no GPU present)")
    return "gloo"
