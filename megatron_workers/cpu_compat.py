"""The only place that adapts Megatron-Core to a CPU-only machine (gloo instead of NCCL).

Megatron-Core is written for CUDA; on a machine without a GPU a handful of its assumptions
break. `apply_cpu_compat()` patches exactly those, and nothing else in polyturn knows it may be
running on a CPU. Measured against megatron-core 0.16.1 and torch 2.14.1 (a CUDA build):

- `torch.cuda.current_device()` is used as the device of every parameter, activation buffer and
  P2P shape tensor. It must answer `torch.device("cpu")` (answering 0 would mean `cuda:0`).
- `Tensor.cuda()` moves tensors "to the GPU" in a few places on the common path (the tied
  embedding copy on the last pipeline stage, the optimizer's state loading); without a GPU it
  returns the tensor as it is (on a machine without a GPU it could only have raised).
- `torch.cuda.synchronize()` guards batched P2P ops in the pipeline schedule; on CPU there is
  nothing to wait for, so it becomes a no-op.
- The pipeline schedules (token counters), the optimizer (`FP32Optimizer._scale`, overflow
  buffers), the grad-norm code in `clip_grads` and `megatron.core.utils` allocate tensors with
  `device="cuda"`; they are created on the CPU instead, only inside those modules, through a view
  of `torch` whose `zeros/ones/empty/full/tensor/arange` map a CUDA device to the CPU.
- `clip_grad_by_total_norm_fp32` asserts `torch.cuda.FloatTensor` grads; the optimizer gets a
  version with the same math (scale every grad by max_norm / (total_norm + 1e-6) when below 1)
  that accepts CPU grads.

The import stand-ins (`flash_mla` raising ImportError instead of OSError, `sgl_kernel`) are put
on the import path by `cpu_standins.activate()`, called when this module is imported, i.e. before
anything in `megatron_workers` imports megatron. With a GPU present, both do nothing.
"""
from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import cpu_standins

cpu_standins.activate()

import torch  # noqa: E402  (must follow the stand-ins)

logger = logging.getLogger(__name__)

_MARK = "_polyturn_cpu_compat"
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")
# Modules that create tensors with device="cuda" on the CPU-reachable path (megatron-core 0.16.1).
_CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)


def _cpu_device(*_args: Any, **_kwargs: Any) -> torch.device:
    return torch.device("cpu")


def _noop(*_args: Any, **_kwargs: Any) -> None:
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


def _torch_view_on_cpu() -> types.ModuleType:
    """A module that forwards every attribute to `torch` but whose factories create CPU tensors."""
    view = types.ModuleType("torch", doc="torch, with CUDA-device tensor factories sent to the CPU")
    view.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[attr-defined]
    for name in _FACTORIES:
        setattr(view, name, _on_cpu(getattr(torch, name)))
    setattr(view, _MARK, True)
    return view


def apply_cpu_compat() -> bool:
    """Adapt Megatron-Core to CPU + gloo when no GPU is present; idempotent.

    Returns True when the CPU adaptations are active (applied now or before), False with a GPU.
    Call it before building models or running a pipeline schedule (`megatron_workers.parallel`
    calls it from `init_distributed`).
    """
    if cpu_standins.gpu_present():
        return False
    if getattr(torch.cuda.current_device, _MARK, False):
        return True
    current_device = _cpu_device
    setattr(current_device, _MARK, True)
    torch.cuda.current_device = current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _noop  # type: ignore[assignment]
    torch.Tensor.cuda = _tensor_stays  # type: ignore[method-assign]

    import importlib

    for name in _CUDA_FACTORY_MODULES:
        module = importlib.import_module(name)
        if not getattr(module.torch, _MARK, False):
            module.torch = _torch_view_on_cpu()
    from megatron.core.optimizer import optimizer

    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    logger.info("megatron-core adapted to CPU + gloo (no GPU present)")
    return True
