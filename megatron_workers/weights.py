"""Weight-sync export: HF-named full tensors from Megatron, grouped into buckets by byte size.

The sender side of weight sync. `iter_hf_tensors` (`model.py`) gathers each tensor's TP
shards and broadcasts it over the pipeline group, one tensor at a time, in HF names; this
module groups that stream into buckets of about `bucket_bytes`, so a receiver (an SGLang
engine's `update_weights_from_tensor`) gets a few large calls instead of one per tensor,
and peak extra memory stays near one bucket.

Where it departs from verl / slime: no dtype cast happens here; tensors keep the trainer's
dtype and the engine's loader casts them into its own parameters. A tensor larger than the
bucket gets a bucket of its own (never split).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return tensor.numel() * tensor.element_size()


def bucket_by_bytes(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive groups of `(name, tensor)` whose sizes add up to at most `bucket_bytes`, in order.

    A tensor larger than `bucket_bytes` forms its own bucket. Every tensor appears exactly once.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}; raise update_weights_bucket_megabytes")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        n = tensor_bytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket
