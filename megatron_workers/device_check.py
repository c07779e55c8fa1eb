"""Host/device discipline, checkable on a CPU: which side of the device seam each tensor lives on.

On a GPU a tensor on the wrong side of the seam is a crash ("Expected all tensors to be on the
same device"); on a CPU every tensor is a CPU tensor and the same bug passes silently. The Megatron
ranks move a micro-batch to the device once (`to_device`) and bring results back once (`to_host`);
`DeviceDiscipline` makes the CPU run as strict as a GPU run would be about that:

- every tensor is tagged HOST or DEVICE as it is made: the caller's batch and tensors created
  without a `device=` (PyTorch's default device is the host) are HOST; parameters, gradient
  buffers, optimizer state and tensors created with an explicit `device=` are DEVICE; every other
  op's outputs take the side of its inputs;
- an op whose tensor inputs come from both sides raises `DeviceMixError`, naming the op and the
  innermost polyturn frame, except where PyTorch itself allows it: a 0-dim host tensor is a scalar
  operand, and advanced-indexing index tensors may live on the host;
- only `to_device` / `to_host` change a tensor's side; a cross-side `copy_` elsewhere is refused too.

The seam functions are also the production code path: with no checker active they only move
tensors (a contextvar read per call). Tensors made before the checker starts and not registered
are untagged and never refused (Megatron's caches, for instance).
"""
from __future__ import annotations

import contextlib
import contextvars
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

HOST, DEVICE = "host", "device"
_crossing: contextvars.ContextVar[str | None] = contextvars.ContextVar("polyturn_device_crossing", default=None)
_ROOT = str(Path(__file__).resolve().parent.parent)

# Ops whose index tensors may sit on the host while the indexed tensor is on the device.
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
             torch.ops.aten._index_put_impl_.default}
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
              torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.scalar_tensor}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.copy.default}


class DeviceMixError(RuntimeError):
    """An op mixed host and device tensors (a crash on a GPU)."""


def to_device(tree: Any, device: torch.device) -> Any:
    """The seam, inbound: every tensor in `tree` (dicts / lists / tuples) moved to `device`, as new tensors."""
    token = _crossing.set(DEVICE)
    try:
        return tree_map(lambda t: t.to(device, non_blocking=True, copy=True) if torch.is_tensor(t) else t, tree)
    finally:
        _crossing.reset(token)


def to_host(tree: Any) -> Any:
    """The seam, outbound: every tensor in `tree` detached and copied to host memory."""
    token = _crossing.set(HOST)
    try:
        return tree_map(lambda t: t.detach().to("cpu", copy=True) if torch.is_tensor(t) else t, tree)
    finally:
        _crossing.reset(token)


def _caller() -> str:
    """The innermost stack frame in polyturn's own code (not this module), as `file:line in func`."""
    for frame in reversed(traceback.extract_stack()):
        if (frame.filename.startswith(_ROOT) and "site-packages" not in frame.filename
                and not frame.filename.endswith("device_check.py")):
            return f"{Path(frame.filename).relative_to(_ROOT)}:{frame.lineno} in {frame.name}"
    return "(outside polyturn)"


class _Factories(TorchFunctionMode):
    """Tags what tensor factories make, from the call as written: an explicit `device=` is the device (the
    ranks' code names `torch.cuda.current_device()`), none is the host (PyTorch's default device)."""

    def __init__(self, side: WeakTensorKeyDictionary) -> None:
        super().__init__()
        self.side = side

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES and torch.is_tensor(out) and _crossing.get() is None:
            self.side[out] = DEVICE if kwargs.get("device") is not None else HOST
        return out


class DeviceDiscipline(TorchDispatchMode):
    """Refuse ops that mix host and device tensors; see the module docstring. Use as a context manager,
    after registering what is on each side with `host(...)` and `device(...)`."""

    def __init__(self) -> None:
        super().__init__()
        self.side = WeakTensorKeyDictionary()
        self.crossings = 0  # tensors moved by to_device / to_host while active

    def host(self, tensors: Iterable[torch.Tensor]) -> DeviceDiscipline:
        for t in tensors:
            self.side[t] = HOST
        return self

    def device(self, tensors: Iterable[torch.Tensor]) -> DeviceDiscipline:
        for t in tensors:
            self.side[t] = DEVICE
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        crossing = _crossing.get()
        if crossing is not None and func in _COPIES:
            side = crossing
            self.crossings += 1
        else:
            side = self._side_of(func, args, kwargs)
        if side is not None:
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t):
                    self.side[t] = side
            if func._schema.is_mutable and args and torch.is_tensor(args[0]):
                self.side[args[0]] = side
        return out

    def _side_of(self, func, args, kwargs) -> str | None:
        operands = [args[0]] if func in _INDEXING else tree_flatten((args, kwargs))[0]
        if func in (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
                    torch.ops.aten._index_put_impl_.default):
            operands.append(args[2])  # the values written
        tensors = [t for t in operands if torch.is_tensor(t)]
        if not tensors:  # a factory: `_Factories` tags it from the call as written
            return None
        sides = {self.side.get(t) for t in tensors if not (t.dim() == 0 and self.side.get(t) == HOST)}
        sides.discard(None)
        if len(sides) > 1:
            shapes = ", ".join(f"{self.side.get(t, '?')}{tuple(t.shape)}" for t in tensors)
            raise DeviceMixError(f"{func} mixes host and device tensors ({shapes}) at {_caller()}; move the "
                                 "micro-batch to the device once (device_check.to_device) and results back once "
                                 "(device_check.to_host)")
        if sides:
            return sides.pop()
        return HOST if any(t.dim() == 0 and self.side.get(t) == HOST for t in tensors) else None


@contextlib.contextmanager
def discipline(host: Iterable[torch.Tensor] = (), device: Iterable[torch.Tensor] = ()) -> Iterator[DeviceDiscipline]:
    """`with discipline(host=batch.values(), device=model_tensors) as d:` run code under `DeviceDiscipline`."""
    mode = DeviceDiscipline().host(host).device(device)
    with _Factories(mode.side), mode:
        yield mode
