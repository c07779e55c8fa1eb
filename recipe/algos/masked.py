"""Masked reductions over the response-token axis.

A position counts when its mask is 1 (a token the policy sampled). Masked-out positions
never reach the result, even when they hold NaN or inf (padding and tool tokens can carry
garbage log-ratios): values are selected with `torch.where`, not multiplied by the mask.

Departure from verl: `masked_mean` of an all-zero mask is 0 (verl divides by 1e-8), and
`masked_var` refuses fewer than two valid positions instead of dividing by zero.
"""
from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over positions where `mask` is 1 (over all positions, or along `dim`)."""
    picked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is 1; 0 where the mask is empty."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `x` over all masked positions (Bessel-corrected when `unbiased`)."""
    count = int(mask.sum())
    if count < (2 if unbiased else 1):
        raise ValueError(
            f"masked_var needs at least {2 if unbiased else 1} positions with mask 1, got {count}; "
            "the batch has (almost) no sampled response tokens"
        )
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return var * count / (count - 1) if unbiased else var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise `x` to unit variance over masked positions; zero mean too if `shift_mean`.

    Statistics are global over the whole batch (not per row). Values at masked-out
    positions are transformed the same way but carry no meaning; callers zero them.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean
