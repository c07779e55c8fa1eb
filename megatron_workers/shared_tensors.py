"""Tensors shared between processes by handle, not by value: the weight sync's tensor path.

`serialize` pickles a bucket's tensors by shared handle: host tensors by the shared-memory name of their storage
(rebuilt by `rebuild_shared_view` through the receiving process's kept mapping of the buffer, `SharedMappings`),
CUDA tensors by torch's IPC handle with the device given as its UUID. `shared_buffer` makes host buffers other
processes can map by name. The receiving side (an SGLang engine's TP rank) imports only `rebuild_shared_view`
(`rollout.sglang_cpu.HOST_TENSOR_REBUILD` names it).
"""
from __future__ import annotations

import io
import mmap
import os
from typing import Any

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler


class SharedMappings:
    """Writable mappings of other processes' shared-memory buffers, by name, kept across syncs.

    A fresh mapping costs a page fault per page touched (writing into one: about three times the copy, measured
    here) and an unmapping after; a kept one costs nothing after the first sync. Used by a sender's TP peers (the
    in-place fill) and by the engine processes that load its buckets (`rebuild_shared_view`). They are plain
    `mmap`s, which torch's shared-memory bookkeeping never counts: the owner's torch unlinks a buffer's file when it
    frees the buffer or dies, and mappings whose file is gone are dropped when a new one is made.
    """

    def __init__(self) -> None:
        self._maps: dict[str, torch.Tensor] = {}  # name -> (file bytes,) uint8

    def view(self, name: str, nbytes: int) -> torch.Tensor:
        """The `nbytes` bytes of the storage in shared-memory file `name` (torch puts a header before them)."""
        file = self._maps.get(name)
        if file is None:
            self._maps = {n: m for n, m in self._maps.items() if os.path.exists(_shm_path(n))}
            fd = os.open(_shm_path(name), os.O_RDWR)
            try:  # populated at once: cheaper than faulting the pages in one by one
                file = self._maps[name] = torch.frombuffer(
                    mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), dtype=torch.uint8)
            finally:
                os.close(fd)
        return file[file.numel() - nbytes:]


def shared_name(t: torch.Tensor) -> str:
    """The shared-memory name of a host tensor's storage (moved to shared memory first if it is not there)."""
    return t.untyped_storage()._share_filename_cpu_()[1].decode()


def _shm_path(name: str) -> str:
    return f"/dev/shm/{name.lstrip('/')}"


_RECEIVED = SharedMappings()  # in a process that loads buckets (an engine's TP rank)


def rebuild_shared_view(name: str, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...],
                        stride: tuple[int, ...], offset: int) -> torch.Tensor:
    """Unpickle a host tensor `serialize` pickled: a view of the `nbytes`-byte storage in shared-memory file `name`
    (`offset` in elements), through this process's kept mapping of it."""
    flat = _RECEIVED.view(name, nbytes)
    return torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), flat.storage_offset() // dtype.itemsize + offset,
                                            shape, stride)


def shared_buffer(size: int, device: torch.device) -> torch.Tensor:
    """`size` bytes other processes can map. CPU storage is made by shared-memory *name* (what `serialize` pickles
    and `SharedMappings` maps): one made by file descriptor would be copied into a named one when pickled."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    return torch.empty(0, dtype=torch.uint8, device=device).set_(torch.UntypedStorage._new_shared(size, device=device))


def serialize(obj: Any) -> bytes:
    """Pickle with tensors by shared handle, not by value.

    CPU tensors go by shared-memory name, rebuilt by `rebuild_shared_view` through the receiving process's kept
    mapping of the buffer (torch's own reduction would map and unmap it per bucket); CUDA tensors by torch's IPC
    handle, their device given as its UUID (the receiving engine maps it back to its own device index).
    """
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = dict(pickler.dispatch_table)  # this pickler only
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dump(obj)
    return buf.getvalue()


def _reduce_tensor(t: torch.Tensor):
    from torch.multiprocessing import reductions

    if t.device.type == "cpu":  # moved to shared memory first if it is not there (as torch's reduction does)
        return rebuild_shared_view, (shared_name(t), t.untyped_storage().nbytes(), t.dtype, tuple(t.shape), t.stride(),
                                     t.storage_offset())
    fn, args = reductions.reduce_tensor(t)
    if t.is_cuda:  # argument 6 of rebuild_cuda_tensor is the device index
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return fn, args
