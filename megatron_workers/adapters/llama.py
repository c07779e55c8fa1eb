"""Llama (`LlamaForCausalLM`): no biases, plain RoPE (rope scaling, as in Llama 3.1+, is refused)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_workers.adapters.base import DecoderShape, decoder_shape, refuse_true

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"


def read_shape(cfg: Mapping[str, Any]) -> DecoderShape:
    """The decoder's shape; raises ValueError naming the first unsupported field."""
    refuse_true(cfg, ("attention_bias", "mlp_bias"),
                "Megatron's GPT layer has no o_proj/MLP bias without biasing every linear layer")
    return decoder_shape(cfg, qkv_bias=False, qk_norm=False)
