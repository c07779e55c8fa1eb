"""Padded rows <-> one packed sequence (Megatron's THD layout): what every Megatron pass feeds the model.

A micro-batch arrives in verl's padded layout, `input_ids` / `attention_mask (b, S)`. Its real
tokens (attention_mask = 1) are concatenated row after row into `ids (1, t)`, t = the number of
real tokens, with `cu_seqlens (b + 1,)` marking where each row's sequence starts and positions
restarting at 0 per sequence (HF's `cumsum(mask) - 1`). `index (b, S)` maps every real token back
to its place in the pack, so the model's `(1, t, ...)` outputs return onto the padded axes with
the same masks. No token of padding is computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Pack", "pack"]


@dataclass
class Pack:
    """One micro-batch's real tokens, packed."""

    ids: torch.Tensor  # (1, t) token ids (t: the real tokens, and any padding to `multiple`)
    positions: torch.Tensor  # (1, t) position within each sequence
    cu_seqlens: torch.Tensor  # (b + 1,) int32, sequence i is [cu[i], cu[i+1]); (b + 2,) with padding
    max_seqlen: int  # longest sequence
    index: torch.Tensor  # (b, S) long: place in the pack of each real token, -1 on padding

    def tensors(self) -> dict[str, torch.Tensor]:
        """The pack's tensors, named for the device batch."""
        return {"packed_ids": self.ids, "packed_positions": self.positions,
                "cu_seqlens": self.cu_seqlens, "pack_index": self.index}


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int = 1, length: int | None = None) -> Pack:
    """Pack the real tokens of `input_ids (b, S)` (where `attention_mask (b, S)` is 1), row by row.

    `multiple` > 1 (sequence parallelism splits the pack over the TP ranks) pads the pack to a multiple of it
    with a last sequence of token 0 that no row's `index` points to; `length` (at least the real tokens) pads it
    to exactly that many tokens the same way.
    """
    real = attention_mask.bool()  # (b, S)
    lengths = real.sum(dim=1)  # (b,)
    t = int(lengths.sum())
    pad = -t % multiple if length is None else length - t
    if pad < 0:
        raise ValueError(f"pack length {length} is shorter than the {t} real tokens")
    if pad:
        lengths = torch.cat([lengths, torch.tensor([pad])])
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    index = torch.full(real.shape, -1, dtype=torch.long)  # (b, S)
    index[real] = torch.arange(t)  # row-major: row i's tokens fill [cu[i], cu[i+1]) in order
    positions = (torch.cumsum(real.long(), dim=1) - 1)[real]  # (t,)
    ids = input_ids[real]  # (t,)
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        positions = torch.cat([positions, torch.arange(pad)])
    return Pack(ids=ids.unsqueeze(0), positions=positions.unsqueeze(0), cu_seqlens=cu_seqlens,
                max_seqlen=int(lengths.max()) if len(lengths) else 0, index=index)
