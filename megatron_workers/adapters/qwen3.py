"""Qwen3 dense (`Qwen3ForCausalLM`): RMSNorm on each q and k head before RoPE (HF `q_norm` / `k_norm`,
Megatron's `qk_layernorm`), an explicit `head_dim` (kv_channels; 128 in every Qwen3 size, not
hidden/heads), no biases, full attention. Qwen3-MoE is another architecture and is not covered."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_workers.adapters.base import (
    DecoderShape,
    decoder_shape,
    refuse_sliding_window,
    refuse_true,
)

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"


def read_shape(cfg: Mapping[str, Any]) -> DecoderShape:
    """The decoder's shape; raises ValueError naming the first unsupported field."""
    refuse_sliding_window(cfg)
    refuse_true(cfg, ("attention_bias",), "Qwen3's attention_bias also biases o_proj, which Megatron's "
                "GPT layer cannot express without biasing every linear layer")
    return decoder_shape(cfg, qkv_bias=False, qk_norm=True)
