"""Input checks shared by the algorithm functions.

Every check raises `ValueError` with a message that names the offending tensor, the
sample (row) and what would fix it, so a bad batch fails at the algorithm boundary
instead of becoming a silent NaN in the weights.
"""
from __future__ import annotations

import torch
from torch import Tensor


def check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    """Raise if `a` and `b` do not have the same shape, naming both tensors and shapes."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(
            f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}; "
            f"they must match (one row per sample, one column per response token)"
        )


def check_2d(name: str, x: Tensor) -> None:
    """Raise unless `x` is a (B, T) tensor."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be a (batch, response_len) tensor, got shape {tuple(x.shape)}")


def check_finite(name: str, x: Tensor, mask: Tensor | None = None, where: str = "sample") -> None:
    """Raise if `x` holds NaN/inf (only where `mask` is 1, if given), naming the first bad row.

    `x` is (B,) or (B, T); `mask` has the shape of `x`. `where` names what a row is
    ("sample" for a whole batch, "micro-batch row" inside a loss).
    """
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask.bool()
    if not bool(bad.any()):
        return
    bad_rows = bad if bad.dim() == 1 else bad.any(dim=-1)  # (B,)
    row = int(torch.nonzero(bad_rows)[0, 0])
    if x.dim() == 1:
        raise ValueError(f"{name} of {where} {row} is {x[row].item()}; it must be finite (check what produced it)")
    col = int(torch.nonzero(bad[row])[0, 0])
    raise ValueError(
        f"{name} of {where} {row} is {x[row, col].item()} at token {col}; "
        f"it must be finite (check what produced it for that {where})"
    )


def check_mask_values(name: str, mask: Tensor) -> None:
    """Raise unless `mask` holds only 0 and 1."""
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must hold only 0 and 1 (1 = token the policy sampled)")
