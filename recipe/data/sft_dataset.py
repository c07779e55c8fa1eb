"""The multi-turn SFT dataset: verl's multi-turn SFT parquet -> token ids and loss masks -> padded batches.

A row holds a `messages` column (chat messages: system / user / assistant with optional
`tool_calls` / tool) and an optional `tools` column (OpenAI function schemas, as a list or a
JSON string). Each conversation becomes the same record a rollout produces, built the way the
agent loop builds it (`rollout.chat_codec.ChatCodec`, `rollout.trajectory.Trajectory`):

- the messages before the first assistant turn, with the row's tool schemas and the generation
  prompt, are the prompt (`ChatCodec.prompt_ids`);
- each assistant message is the ids a policy samples for it, through its stop token
  (`ChatCodec.assistant_ids`), appended with mask 1;
- the messages between two assistant turns (tool responses, user turns) are the template's
  delta after the stop token, up to the next generation prompt (`ChatCodec.delta_ids`),
  appended with mask 0.

So the SFT loss sees exactly the tokens and the mask that RL later trains on for the same
conversation (a test compares them with a rollout's). Messages after the last assistant turn
carry no loss and are dropped.

Where it departs from verl's `MultiTurnSFTDataset`: the template is rendered per turn the
rollout's way instead of once over the whole chat and then masked by token offsets, and the
batch is the RL layout (prompt left-padded, response right-padded: `recipe.batch.collate`).
Parquet stores `tool_calls`, `tools` and dict-valued arguments as structs over every row's
fields, so null entries are dropped when a row is read. Truncation (`data.truncation`):
`error` refuses a conversation longer than `data.max_length` naming its row; `right` cuts the
response end (a conversation whose prompt alone does not fit is refused either way).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from recipe.batch import collate
from recipe.data.dataset import epoch_batches, read_parquet_rows
from rollout.chat_codec import ChatCodec
from rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "right")
SFT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")  # what update_sft reads


def _drop_nulls(value: Any) -> Any:
    """`value` without null dict entries, recursively (parquet's struct unification fills them in)."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"{where}: each message needs a `role`, got {m!r}")
    out = _drop_nulls(m)
    out["content"] = out.get("content") or ""
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return out


def _tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A row's tool schemas: a list of OpenAI function schemas, or a JSON string of one; None when empty."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: the tools column is not valid JSON ({err})") from None
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ValueError(f"{where}: the tools column must be a list of OpenAI function schemas (or a JSON string of one)")
    return _drop_nulls(value) or None


def encode_conversation(codec: ChatCodec, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        uid: str) -> Trajectory:
    """One conversation as the record a rollout of it would be: prompt ids, response ids, mask 1 on assistant tokens."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError(f"{uid}: no assistant message; a demonstration needs at least one assistant turn")
    if first == 0:
        raise ValueError(f"{uid}: the conversation starts with an assistant message; it needs a user message first")
    traj = Trajectory(uid=uid, prompt_uid=uid, sample_index=0, prompt_ids=codec.prompt_ids(messages[:first], tools),
                      messages=list(messages))
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    stop: int | None = None
    pending: list[dict[str, Any]] = []  # messages since the last assistant turn
    for m in messages[first:last + 1]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if stop is not None:  # the template's tokens between two assistant turns (only glue when nothing came between)
            traj.append_context(codec.delta_ids(pending, stop), role=pending[0]["role"] if pending else "template")
            pending = []
        ids = codec.assistant_ids(m)
        traj.append_assistant(ids, [0.0] * len(ids), weight_version=0)  # a demonstration: no sampling log-probs
        stop = ids[-1]
    return traj


def _truncate(traj: Trajectory, max_length: int, truncation: str) -> Trajectory:
    """`traj` within `max_length` tokens by `data.truncation` (error: refuse; right: cut the response end)."""
    excess = traj.total_length - max_length
    if excess <= 0:
        return traj
    if truncation == "error" or len(traj.prompt_ids) >= max_length:
        raise ValueError(f"{traj.uid}: {traj.total_length} tokens (prompt {len(traj.prompt_ids)}) > data.max_length="
                         f"{max_length}; raise data.max_length, set data.truncation=right, or drop the row")
    keep = len(traj.response_ids) - excess
    if not any(traj.response_mask[:keep]):
        raise ValueError(f"{traj.uid}: no assistant token is left within data.max_length={max_length}; raise it")
    traj.response_ids, traj.response_mask = traj.response_ids[:keep], traj.response_mask[:keep]
    traj.rollout_logprobs = traj.rollout_logprobs[:keep]
    traj.turns = [t for t in traj.turns if t.start < keep]
    traj.turns[-1].end = min(traj.turns[-1].end, keep)
    return traj


class SFTDataset:
    """Encoded demonstrations of one or more parquet files, served as shuffled padded batches."""

    def __init__(self, files: Sequence[str | Path], codec: ChatCodec, *, messages_key: str = "messages",
                 tools_key: str = "tools", max_length: int = 1024, truncation: str = "error"):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation={truncation!r}; use one of {TRUNCATIONS}")
        self.pad_token_id = codec.tokenizer.pad_token_id if codec.tokenizer.pad_token_id is not None \
            else codec.tokenizer.eos_token_id
        self.items: list[Trajectory] = []
        cut = 0
        for where, row in read_parquet_rows(files):
            if messages_key not in row:
                raise ValueError(f"{where}: no {messages_key!r} column (columns: {sorted(row)}); set "
                                 "data.multiturn.messages_key to the column holding the chat messages")
            raw = row[messages_key]
            if isinstance(raw, str):
                raw = json.loads(raw)
            if not isinstance(raw, list) or not raw:
                raise ValueError(f"{where}: {messages_key!r} must be a non-empty list of chat messages")
            messages = [_message(m, where) for m in raw]
            traj = encode_conversation(codec, messages, _tools(row.get(tools_key), where), where)
            length = traj.total_length
            self.items.append(_truncate(traj, max_length, truncation))
            cut += self.items[-1].total_length < length
        if cut:
            logger.warning("cut %d of %d conversations to data.max_length=%d", cut, len(self.items), max_length)
        if not self.items:
            raise ValueError(f"no rows in {list(files)}")

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_loss_tokens(self) -> int:
        """Assistant (mask-1) tokens over the dataset."""
        return sum(sum(t.response_mask) for t in self.items)

    def collate(self, items: list[Trajectory]) -> dict[str, torch.Tensor]:
        """The update_sft batch of `items` (RL layout: `(B, S)` sequence tensors, `(B, T)` responses and mask)."""
        batch = collate(items, self.pad_token_id)
        return {k: batch[k] for k in SFT_KEYS}

    def batches(self, batch_size: int, *, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Endless batches of `batch_size` conversations: one seeded shuffle per epoch, the last partial batch dropped."""
        for _, chosen in epoch_batches(len(self.items), batch_size, seed=seed):
            yield self.collate([self.items[i] for i in chosen])
