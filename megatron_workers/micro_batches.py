"""A batch's checks and its micro-batches: which rows go together, each packed into one sequence.

Batch layout (verl's): `input_ids`, `attention_mask`, `position_ids` are `(B, S)`; `responses`,
`response_mask` are `(B, T)` and the response is the last `T` columns of the sequence (prompt
left-padded, response right-padded). `response_mask` is 1 on tokens the policy sampled, 0 on tool /
user / template tokens and padding. Pure host-side tensor code: `runner.py` cuts each pass's
micro-batches here and sends them to the device one at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_workers import packing
from megatron_workers.config import WorkerConfig

Batch = dict[str, torch.Tensor]
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")  # (B, S)
RESPONSE_KEYS = ("responses", "response_mask")  # (B, T)



def validate_batch(batch: Batch, offset: int = 0) -> None:
    """Refuse a malformed batch; errors name the key and the sample index (`offset` + row).

    Checks: all layout keys present with the shapes above; `responses` equal the last `T`
    ids of `input_ids` where sampled; every response has at least one sampled token and a
    prompt token before it; no float tensor (advantages, rewards, old log-probs...) holds NaN/inf.
    """
    missing = [k for k in (*SEQUENCE_KEYS, *RESPONSE_KEYS) if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; it needs {SEQUENCE_KEYS + RESPONSE_KEYS}")
    B, S = batch["input_ids"].shape
    T = batch["responses"].shape[1] if batch["responses"].dim() == 2 else -1
    expected = {**{k: (B, S) for k in SEQUENCE_KEYS}, **{k: (B, T) for k in RESPONSE_KEYS}}
    for k, v in batch.items():
        want = expected.get(k)
        if want is not None and tuple(v.shape) != want:
            raise ValueError(f"batch[{k!r}] has shape {tuple(v.shape)}, expected {want} (input_ids is {(B, S)})")
        if want is None and v.dim() >= 1 and v.shape[0] != B:
            raise ValueError(f"batch[{k!r}] has {v.shape[0]} rows, input_ids has {B}")
    if T > S:
        raise ValueError(f"responses are longer ({T}) than the sequences ({S})")
    resp_mask = batch["response_mask"]
    mismatch = ((batch["input_ids"][:, S - T:] != batch["responses"]) & (resp_mask > 0)).any(dim=1)
    if mismatch.any():
        i = int(mismatch.nonzero()[0])
        raise ValueError(
            f"sample {offset + i}: responses differ from the last {T} input_ids on masked tokens; "
            "the response must be the right end of the sequence (prompt left-padded, response right-padded)"
        )
    empty = resp_mask.sum(dim=1) == 0
    if empty.any():
        i = int(empty.nonzero()[0])
        raise ValueError(f"sample {offset + i}: empty response (response_mask is all 0); drop it from the batch")
    no_prompt = batch["attention_mask"][:, S - T - 1] == 0 if T < S else torch.ones(B, dtype=torch.bool)
    if no_prompt.any():
        i = int(no_prompt.nonzero()[0])
        raise ValueError(f"sample {offset + i}: no prompt token right before the response (attention_mask is 0 there)")
    for k, v in batch.items():
        if v.is_floating_point():
            bad = ~torch.isfinite(v.reshape(B, -1)).all(dim=1)
            if bad.any():
                i = int(bad.nonzero()[0])
                raise ValueError(f"sample {offset + i}: batch[{k!r}] holds NaN or inf")


@dataclass
class MicroBatch:
    """Rows of a batch and their real tokens packed into one sequence (`packing.pack`)."""

    rows: torch.Tensor  # (b,) indices into the parent batch
    tensors: Batch  # parent tensors restricted to `rows`
    pack: packing.Pack

    @property
    def tokens(self) -> int:
        """What the model computes: the real tokens (and the padding to the sequence-parallel multiple)."""
        return int(self.pack.cu_seqlens[-1])

    def device_batch(self) -> Batch:
        """What goes to the device: the pack (`packed_ids`, `packed_positions (1, t)`, `cu_seqlens (b + 1,)`),
        `response_index (b, T)` (the pack position that predicts each response token, -1 on padding) and
        the rows' response-axis and per-sample tensors; the padded sequence keys stay on the host."""
        S, T = self.tensors["input_ids"].shape[1], self.tensors["responses"].shape[1]
        real = self.tensors["attention_mask"][:, S - T:].bool()  # (b, T)
        response_index = torch.where(real, self.pack.index[:, S - T - 1: S - 1], -1)  # (b, T)
        return {**{k: v for k, v in self.tensors.items() if k not in SEQUENCE_KEYS},
                "packed_ids": self.pack.ids, "packed_positions": self.pack.positions,
                "cu_seqlens": self.pack.cu_seqlens, "response_index": response_index}


def _make_micro_batch(batch: Batch, rows: torch.Tensor, multiple: int, length: int | None = None) -> MicroBatch:
    tensors = {k: v.index_select(0, rows) for k, v in batch.items()}
    return MicroBatch(rows=rows, tensors=tensors,
                      pack=packing.pack(tensors["input_ids"], tensors["attention_mask"], multiple, length))


def split_micro_batches(batch: Batch, cfg: WorkerConfig, forward_only: bool = False,
                        multiple: int = 1, interleaved_pp: int = 1) -> list[MicroBatch]:
    """Fixed-size micro-batches in order, or (use_dynamic_bsz) rows packed first-fit by decreasing
    length so that each micro-batch's real tokens stay within `ppo_max_token_len_per_gpu` (a longer
    single row gets its own). `forward_only` passes (log-probs, values) use the `log_prob_*` sizes
    where they are set. Each pack is padded to a multiple of `multiple` (the TP size under sequence parallelism).

    `interleaved_pp` > 1 (the PP size under virtual pipeline stages) shapes them for Megatron's interleaved schedule,
    which runs micro-batches in groups of PP and exchanges fixed shapes between stages: when the count is not a
    multiple of PP, the rows are spread over the next multiple instead, balancing real tokens (smaller micro-batches,
    so both limits still hold), where there are enough rows; and every pack is padded to the longest one's length."""
    B = batch["input_ids"].shape[0]
    size, dynamic, max_tokens = cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu
    if forward_only:
        size = cfg.log_prob_micro_batch_size_per_gpu or size
        dynamic = dynamic if cfg.log_prob_use_dynamic_bsz is None else cfg.log_prob_use_dynamic_bsz
        max_tokens = cfg.log_prob_max_token_len_per_gpu or max_tokens
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    if not dynamic:
        packs = [list(range(i, min(i + size, B))) for i in range(0, B, size)]
    else:
        packs, loads = [], []
        for i in sorted(range(B), key=lambda r: -lengths[r]):
            fit = next((p for p, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
            if fit is None:
                packs.append([i])
                loads.append(lengths[i])
            else:
                packs[fit].append(i)
                loads[fit] += lengths[i]
    if interleaved_pp == 1:
        return [_make_micro_batch(batch, torch.tensor(sorted(p)), multiple) for p in packs]
    count = -(-len(packs) // interleaved_pp) * interleaved_pp
    if count != len(packs) and count <= B:
        packs = _balanced(lengths, count)
    longest = max(sum(lengths[r] for r in p) for p in packs)
    return [_make_micro_batch(batch, torch.tensor(sorted(p)), multiple, length=-(-longest // multiple) * multiple)
            for p in packs]


def _balanced(lengths: list[int], count: int) -> list[list[int]]:
    """Rows spread over `count` non-empty groups (count <= rows), longest first into the lightest group."""
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        g = min(range(count), key=lambda j: (loads[j], len(groups[j])))
        groups[g].append(i)
        loads[g] += lengths[i]
    return groups


def scatter_rows(chunks: list[tuple[torch.Tensor, torch.Tensor]], B: int, T: int) -> torch.Tensor:
    """Host-side: micro-batch results `(rows (b,), values (b, T))` -> one `(B, T)` fp32 tensor."""
    out = torch.zeros(B, T, dtype=torch.float32)  # (B, T)
    for rows, values in chunks:
        out[rows] = values.float()
    return out
