"""Causal self-attention over packed sequences (THD), the core attention of every Megatron rank's model.

Megatron-Core's local `DotProductAttention` materialises `(b, heads, s, s)` scores over a padded
batch and refuses packed sequences; TransformerEngine, which handles them, is not installed. This
module takes Megatron's packed layout instead: the micro-batch's sequences concatenated into one
axis of `t` tokens, `query (t, heads/tp, d)`, `key` / `value (t, groups/tp, d)`, segment borders in
`PackedSeqParams.cu_seqlens_q (n + 1,)`. Each token attends causally within its own sequence, so
no FLOP goes to padding and none to pairs across sequences.

Kernels (`KERNEL`, chosen once per process):

- `flash_varlen` (the default): `torch.nn.attention.varlen.varlen_attn`, PyTorch's
  Flash-Attention over `cu_seqlens`, for bf16 / fp16 on a GPU; fp32 activations take the
  per-segment path below (Flash-Attention has no fp32 kernel). Its signature changed across
  torch releases (`is_causal` became `window_size`; `enable_gqa` came later): the call follows the
  installed one, repeating the key / value heads where it takes no `enable_gqa`.
- `segment_sdpa`: `scaled_dot_product_attention(is_causal=True)` per sequence, PyTorch's fused
  CPU kernels. `cpu_compat.apply_cpu_compat` installs it on a machine without a GPU.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

__all__ = ["KERNEL", "PackedAttention", "flash_varlen", "packed_seq_params", "segment_sdpa"]

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def segment_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int, scale: float) -> torch.Tensor:
    """`q (t, h, d)`, `k`/`v (t, g, d)` -> `(t, h, d)`: causal attention inside each `[cu[i], cu[i+1])`."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        seg = [x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # (1, h|g, s, d)
        o = F.scaled_dot_product_attention(*seg, is_causal=True, scale=scale, enable_gqa=True)  # (1, h, s, d)
        out[lo:hi] = o.squeeze(0).transpose(0, 1)
    return out


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int, scale: float) -> torch.Tensor:
    """As `segment_sdpa`, on PyTorch's varlen Flash-Attention (bf16 / fp16 on a GPU)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return segment_sdpa(q, k, v, cu_seqlens, max_seqlen, scale)
    from torch.nn.attention.varlen import varlen_attn

    causal, gqa = _varlen_options(varlen_attn)
    if gqa:
        causal = {**causal, "enable_gqa": True}
    elif k.shape[1] != q.shape[1]:  # no enable_gqa in this torch: every query head gets its group's key / value
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **causal)


@functools.cache
def _varlen_options(fn: Callable) -> tuple[dict[str, Any], bool]:
    """How the installed `varlen_attn` asks for causal attention, and whether it takes `enable_gqa`."""
    params = inspect.signature(fn).parameters
    return ({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}), "enable_gqa" in params


KERNEL: Kernel = flash_varlen
"""The kernel every `PackedAttention` calls; replaced by `segment_sdpa` through `cpu_compat`."""


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int) -> PackedSeqParams:
    """Megatron's THD description of one pack: `cu_seqlens (n + 1,)` int32 on the model's device."""
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


class PackedAttention(MegatronModule):
    """Megatron core attention (the local spec's `core_attention` slot) for THD-packed sequences.

    Same constructor as Megatron's `DotProductAttention`; `forward` needs `packed_seq_params`
    (see `packed_seq_params`) and ignores `attention_mask` (causality comes from the segments).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if config.context_parallel_size != 1 or dropout or config.apply_query_key_layer_scaling:
            raise ValueError(
                "PackedAttention supports context_parallel_size=1, attention_dropout=0 and no "
                f"apply_query_key_layer_scaling (got {config.context_parallel_size}, {dropout}, "
                f"{config.apply_query_key_layer_scaling})"
            )
        tp = config.tensor_model_parallel_size
        self.heads = divide(config.num_attention_heads, tp)  # query heads on this rank
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                attn_mask_type=None, attention_bias=None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        """`query (t, heads/tp, d)`, `key`/`value (t, groups/tp, d)` -> `(t, heads/tp * d)`."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedAttention needs THD packed_seq_params (megatron_workers.attention.packed_seq_params)")
        if attention_bias is not None:
            raise ValueError("PackedAttention takes no attention_bias")
        out = KERNEL(query, key, value, packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q, self.scale)
        return out.reshape(out.shape[0], self.heads * self.head_dim)
