"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): bias on q/k/v (not on o_proj or the MLP), full attention."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_workers.adapters.base import (
    DecoderShape,
    decoder_shape,
    refuse_sliding_window,
)

ARCHITECTURE = "Qwen2ForCausalLM"
MODEL_TYPE = "qwen2"


def read_shape(cfg: Mapping[str, Any]) -> DecoderShape:
    """The decoder's shape; raises ValueError naming the first unsupported field."""
    refuse_sliding_window(cfg)
    return decoder_shape(cfg, qkv_bias=True, qk_norm=False)
