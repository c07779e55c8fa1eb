"""Trajectories -> the trainer's padded tensors: the one place where the seam's records become a batch.

verl's layout: prompts left-padded, responses right-padded, so every prompt ends at the same
column and `input_ids = cat(prompts, responses)`. Per-sample facts that are not tensors
(data source, ground truth, turn-indexed rewards) stay on the trajectories; the trainer keeps
the list in batch order next to the tensors.
"""
from __future__ import annotations

import torch

from rollout.trajectory import Trajectory

Batch = dict[str, torch.Tensor]


def collate(
    trajectories: list[Trajectory],
    pad_token_id: int,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> Batch:
    """Pad a list of trajectories into the trainer's tensors.

    Prompts are left-padded and responses right-padded, so `input_ids = cat(prompts, responses)`
    has every prompt ending at the same column (verl's layout). Lengths default to the longest
    in the batch; a trajectory longer than a given maximum is refused (never silently cut).

    Returns `prompts (B, P)`, `responses (B, R)`, `input_ids (B, P+R)`, `attention_mask (B, P+R)`,
    `position_ids (B, P+R)`, `response_mask (B, R)` and `rollout_logprobs (B, R)`.
    """
    if not trajectories:
        raise ValueError("collate got no trajectories; the rollout produced an empty batch")
    p_len = max(len(t.prompt_ids) for t in trajectories)
    r_len = max(len(t.response_ids) for t in trajectories)
    for t in trajectories:
        t.check_invariants()
        if max_prompt_length is not None and len(t.prompt_ids) > max_prompt_length:
            raise ValueError(f"trajectory {t.uid}: prompt has {len(t.prompt_ids)} tokens > max_prompt_length {max_prompt_length}")
        if max_response_length is not None and len(t.response_ids) > max_response_length:
            raise ValueError(
                f"trajectory {t.uid}: response has {len(t.response_ids)} tokens > max_response_length {max_response_length}"
            )
    p_len = max_prompt_length if max_prompt_length is not None else p_len
    r_len = max_response_length if max_response_length is not None else r_len
    b = len(trajectories)
    prompts = torch.full((b, p_len), pad_token_id, dtype=torch.long)  # (B, P)
    responses = torch.full((b, r_len), pad_token_id, dtype=torch.long)  # (B, R)
    prompt_attn = torch.zeros((b, p_len), dtype=torch.long)  # (B, P)
    response_attn = torch.zeros((b, r_len), dtype=torch.long)  # (B, R)
    response_mask = torch.zeros((b, r_len), dtype=torch.long)  # (B, R)
    logprobs = torch.zeros((b, r_len), dtype=torch.float32)  # (B, R)
    for i, t in enumerate(trajectories):
        np_, nr = len(t.prompt_ids), len(t.response_ids)
        if np_:
            prompts[i, p_len - np_ :] = torch.tensor(t.prompt_ids, dtype=torch.long)
            prompt_attn[i, p_len - np_ :] = 1
        if nr:
            responses[i, :nr] = torch.tensor(t.response_ids, dtype=torch.long)
            response_attn[i, :nr] = 1
            response_mask[i, :nr] = torch.tensor(t.response_mask, dtype=torch.long)
            logprobs[i, :nr] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)  # (B, P+R)
    # Positions count real tokens only; padding repeats 0 on the left and the last position on the right.
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)  # (B, P+R)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_logprobs": logprobs,
    }
