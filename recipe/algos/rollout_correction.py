"""Rollout correction (`algorithm.rollout_correction.*`, verl v0.9's keys and meaning): weigh each sampled token by
how far the trainer's policy has drifted from the engine that sampled it.

The engine samples with its own kernels (bf16, a different attention, or older weights under an async
schedule), so its log-prob of a token, `rollout_log_probs`, differs from the trainer's `old_log_probs`.
With `log r_t = old_t - rollout_t` (the trainer's over the engine's):

- `rollout_is` (importance sampling): `token`: `w_t = r_t`; `sequence`: one weight `exp(sum_t log r_t)` on all of
  a sample's tokens. `rollout_is_threshold` a number: TIS, `w` clamped at it; `"lower_upper"` (e.g. "0.5_5.0"):
  IcePop, `w` set to 0 outside [lower, upper]. `rollout_is_batch_normalize`: weights divided by their batch mean
  (over tokens, or over samples for `sequence`), before any rejection.
- `rollout_rs` (rejection): verl v0.9's options, several joined by commas (a token survives only if every one
  keeps it): a statistic per token, `k1 = -log r`, `k2 = (log r)^2 / 2` or `k3 = r - 1 - log r`, taken per token
  (`token_k*`) or per sample as its sum, mean or max (`seq_sum_k*`, `seq_mean_k*`, `seq_max_k2|3`). `k1` options
  keep `log lower <= k1 <= log upper` (a threshold "lower_upper", or an upper alone with lower = 1 / upper); `k2` /
  `k3` keep `k <= upper`. As in verl's code, `k1` bounds the ratio engine / trainer (`exp(-log r)`): the same as
  bounding r whenever lower = 1 / upper. The older names stay accepted: `token`, `sequence`, `geometric` are
  `token_k1`, `seq_sum_k1`, `seq_mean_k1`, with older verl's `rollout_rs_threshold_lower` bounding r itself.
- `rollout_token_veto_threshold` (older verl's): a sample holding any token with `r_t` below it gets weight 0.

The result is one `(B, T)` weight, detached, that `losses.policy_loss` multiplies into the per-token policy
loss. Where it departs from verl: a rejected token keeps its place in the loss's token count (weight 0
instead of dropping it from `response_mask`), so no sample ever becomes empty. Log-ratios are clamped to
[-20, 20] before `exp`, verl's safety bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from recipe.algos.checks import check_2d, check_finite, check_same_shape
from recipe.algos.masked import masked_mean

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
OLD_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
"""Older verl's rejection levels and the v0.9 option each is."""
_KEY = "algorithm.rollout_correction"
_BOUND = 20.0


@dataclass(frozen=True)
class RsOption:
    """One rejection criterion: a v0.9 option and its bounds (`lower` only for `k1` options)."""

    name: str
    upper: float
    lower: float | None = None


def _items(value: str | float | list) -> list[str]:
    """A comma-separated string or a list -> its stripped, non-empty items as strings."""
    parts = value if isinstance(value, list) else str(value).split(",")
    return [str(p).strip() for p in parts if str(p).strip()]


def parse_bounds(spec: str | float, key: str) -> tuple[float | None, float]:
    """`2.0` or "2.0" -> (None, 2.0); "0.5_2.0" -> (0.5, 2.0). Bounds must be positive, lower <= upper."""
    text = str(spec).strip()
    low_text, _, up_text = text.rpartition("_") if "_" in text else ("", "", text)
    try:
        lower, upper = (float(low_text) if low_text else None), float(up_text)
    except ValueError:
        raise ValueError(f"{key} is {spec!r}; give a number or 'lower_upper' (e.g. 0.5_2.0)") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{key} is {spec!r}; bounds must be positive with lower <= upper")
    return lower, upper


@dataclass
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction.*`: importance weights of the engine's samples (off by default)."""

    rollout_is: str | None = None
    """Importance sampling: None (off), "token" or "sequence"."""
    rollout_is_threshold: str | float = 2.0
    """A number: TIS, the weight clamped at it (verl's 2.0); "lower_upper" (e.g. "0.5_5.0"): IcePop, a weight
    outside [lower, upper] becomes 0."""
    rollout_is_batch_normalize: bool = False
    """Divide the IS weights by their batch mean (tokens; samples for "sequence"), so they average 1."""
    rollout_rs: str | list | None = None
    """Rejection: None (off) or verl v0.9's options, comma-separated (quoted on the command line) or a list
    (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3); older names token, sequence, geometric =
    token_k1, seq_sum_k1, seq_mean_k1."""
    rollout_rs_threshold: str | float | list | None = None
    """One bound per rollout_rs option (comma-separated, a list, or one for all): k1 options "lower_upper" or an
    upper (lower = 1 / upper); k2 / k3 options an upper. Required when rollout_rs is set."""
    rollout_rs_threshold_lower: float | None = None
    """Older verl's lower bound of the ratio trainer / engine for an older rollout_rs name; None: 1 / upper."""
    rollout_token_veto_threshold: float | None = None
    """Reject a whole sample when one of its tokens has a ratio below this; None: off."""

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"{_KEY}.rollout_is is {self.rollout_is!r}; use null or one of {IS_LEVELS}")
        parse_bounds(self.rollout_is_threshold, f"{_KEY}.rollout_is_threshold")
        self.rs_options()
        if self.rollout_token_veto_threshold is not None and self.rollout_token_veto_threshold <= 0:
            raise ValueError(f"{_KEY}.rollout_token_veto_threshold is {self.rollout_token_veto_threshold}; "
                             "it must be > 0 (or null)")

    @property
    def enabled(self) -> bool:
        return any(x is not None for x in (self.rollout_is, self.rollout_rs, self.rollout_token_veto_threshold))

    def rs_options(self) -> list[RsOption]:
        """The rejection criteria, older names as v0.9 options (an older lower bound turned onto k1's ratio)."""
        if self.rollout_rs is None:
            if self.rollout_rs_threshold_lower is not None:
                raise ValueError(f"{_KEY}.rollout_rs_threshold_lower is set without rollout_rs; drop it")
            return []
        names = list(dict.fromkeys(_items(self.rollout_rs)))
        bad = [n for n in names if n not in RS_OPTIONS and n not in OLD_RS]
        if bad or not names:
            raise ValueError(f"{_KEY}.rollout_rs is {self.rollout_rs!r}; use null or comma-separated options of "
                             f"{RS_OPTIONS} (older: {tuple(OLD_RS)})")
        if self.rollout_rs_threshold is None:
            raise ValueError(f"{_KEY}.rollout_rs={self.rollout_rs} needs rollout_rs_threshold (e.g. 2.0, or "
                             "0.5_2.0 for a k1 option)")
        specs = _items(self.rollout_rs_threshold)
        if len(specs) not in (1, len(names)):
            raise ValueError(f"{_KEY}.rollout_rs_threshold has {len(specs)} values for {len(names)} rollout_rs "
                             "options; give one for all or one per option")
        return [self._option(n, s) for n, s in zip(names, specs * len(names) if len(specs) == 1 else specs)]

    def _option(self, name: str, spec: str) -> RsOption:
        """One option's bounds from its threshold `spec`."""
        key = f"{_KEY}.rollout_rs_threshold"
        lower, upper = parse_bounds(spec, key)
        old_lower = self.rollout_rs_threshold_lower
        if old_lower is not None:  # older verl: the ratio trainer / engine in [old_lower, upper]
            if name not in OLD_RS or lower is not None:
                raise ValueError(f"{_KEY}.rollout_rs_threshold_lower goes with an older rollout_rs name (token, "
                                 f"sequence, geometric) and one upper bound; for {name} give rollout_rs_threshold "
                                 "as lower_upper")
            if not 0 < old_lower < upper:
                raise ValueError(f"{_KEY}.rollout_rs_threshold_lower is {old_lower}; it must lie in (0, "
                                 f"rollout_rs_threshold={upper})")
            return RsOption(OLD_RS[name], upper=1.0 / old_lower, lower=1.0 / upper)
        name = OLD_RS.get(name, name)
        if name.endswith("k1"):
            return RsOption(name, upper=upper, lower=1.0 / upper if lower is None else lower)
        if lower is not None:
            raise ValueError(f"{key} for {name} is {spec!r}: a k2 / k3 option takes one upper bound")
        return RsOption(name, upper=upper)


def _is_weights(log_ratio: Tensor, mask: Tensor, cfg: RolloutCorrectionConfig) -> tuple[Tensor, dict[str, float]]:
    """`(B, T)` IS weights (0 off the mask) and their `rollout_corr/rollout_is_*` metrics."""
    lower, upper = parse_bounds(cfg.rollout_is_threshold, "")
    if cfg.rollout_is == "token":
        raw = log_ratio.clamp(-_BOUND, _BOUND).exp()  # (B, T)
    else:
        raw = log_ratio.sum(dim=1, keepdim=True).clamp(-_BOUND, _BOUND).exp().expand_as(log_ratio)  # (B, T)
    raw = raw * mask
    inside = (raw >= (lower or 0.0)) & (raw <= upper)
    weights = raw.clamp(max=upper) if lower is None else torch.where(inside, raw, torch.zeros_like(raw))
    sel, applied = raw[mask], weights[mask]
    p = "rollout_corr/rollout_is"
    metrics = {f"{p}_mean": float(sel.mean()), f"{p}_max": float(sel.max()), f"{p}_min": float(sel.min()),
               f"{p}_std": float(sel.std()) if sel.numel() > 1 else 0.0,
               f"{p}_ratio_fraction_high": float((sel > upper).float().mean()),
               # Kish's effective sample size of the applied weights, as a fraction of the tokens
               f"{p}_eff_sample_size": float(applied.sum() ** 2 / (applied.square().sum() * applied.numel()))
               if applied.any() else 0.0}
    if lower is not None:
        metrics[f"{p}_oob_ratio"] = float(1.0 - inside[mask].float().mean())
    if cfg.rollout_is_batch_normalize:
        per_sample = weights.sum(1) / mask.sum(1).clamp(min=1)  # (B,)
        mean = applied.mean() if cfg.rollout_is == "token" else per_sample[mask.any(1)].mean()
        if mean > 1e-8:
            weights = weights / mean
        metrics[f"{p}_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
    return weights, metrics


def _rs_keep(opt: RsOption, log_ratio: Tensor, mask: Tensor) -> Tensor:
    """`(B, T)` True where rejection criterion `opt` keeps the token."""
    lr = log_ratio.clamp(-_BOUND, _BOUND)  # (B, T)
    stat = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": lr.exp() - 1.0 - lr}[opt.name[-2:]]  # (B, T)
    level = opt.name.split("_")[1] if opt.name.startswith("seq_") else "token"
    if level == "sum":
        stat = (stat * mask).sum(dim=1, keepdim=True)  # (B, 1)
    elif level == "mean":
        stat = (stat * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    elif level == "max":
        stat = stat.masked_fill(~mask, -math.inf).amax(dim=1, keepdim=True).clamp(min=0.0)  # k2, k3 >= 0
    if opt.lower is not None:
        keep = (stat >= math.log(opt.lower)) & (stat <= math.log(opt.upper))
    else:
        keep = stat <= opt.upper
    return keep.expand_as(mask) & mask


def rollout_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor,
                    cfg: RolloutCorrectionConfig) -> tuple[Tensor, dict[str, float]]:
    """`(B, T)` inputs -> `(weights (B, T), metrics)`: the per-token weight of the policy loss (0 off the mask)
    and `rollout_corr/*` metrics (IS weight statistics, rejected fractions per option and in all)."""
    for name, t in (("old_log_probs", old_log_probs), ("rollout_log_probs", rollout_log_probs)):
        check_2d(name, t)
        check_same_shape(name, t, "response_mask", response_mask)
    mask = response_mask.bool()  # (B, T)
    check_finite("rollout_log_probs", rollout_log_probs, mask)
    log_ratio = torch.where(mask, old_log_probs - rollout_log_probs, torch.zeros_like(old_log_probs))  # (B, T)
    weights, metrics = mask.float(), {}
    if cfg.rollout_is is not None:
        weights, metrics = _is_weights(log_ratio, mask, cfg)
    accept = mask.clone()  # (B, T)
    for opt in cfg.rs_options():
        keep = _rs_keep(opt, log_ratio, mask)
        metrics[f"rollout_corr/rollout_rs_{opt.name}_masked_fraction"] = float(1.0 - masked_mean(keep.float(), mask))
        accept &= keep
    if cfg.rollout_token_veto_threshold is not None:
        token_ratio = log_ratio.clamp(-_BOUND, _BOUND).exp()
        vetoed = (mask & (token_ratio < cfg.rollout_token_veto_threshold)).any(dim=1, keepdim=True)  # (B, 1)
        accept &= ~vetoed
        metrics["rollout_corr/rollout_veto_fraction"] = float(vetoed.float().mean())
    if cfg.rollout_rs is not None or cfg.rollout_token_veto_threshold is not None:
        metrics["rollout_corr/rollout_rs_masked_fraction"] = float(1.0 - masked_mean(accept.float(), mask))
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float(((mask & ~accept).any(dim=1)).float().mean())
        weights = weights * accept.float()
    return weights.detach(), metrics
