"""HF config -> Megatron-Core `TransformerConfig` and this rank's `GPTModel` stage (local layer spec),
and reading an HF checkpoint from disk.

The HF <-> Megatron weight rules live in `megatron_workers.adapters` (one module per architecture);
`load_hf_weights` and `export_hf_state_dict` are imported here for the workers that build and fill a
model through this module.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_workers.adapters import (
    export_hf_state_dict,
    load_hf_weights,
    read_decoder_shape,
)
from megatron_workers.attention import PackedAttention

try:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
except OSError as exc:  # megatron-core's attention imports flash_mla, which needs libcuda
    raise ImportError(
        f"megatron-core's GPT model could not be imported ({exc}); on a machine without a GPU call "
        "megatron_workers.cpu_compat.apply_cpu_compat() at the process's start, before importing "
        "megatron_workers.model"
    ) from exc

logger = logging.getLogger(__name__)

__all__ = [
    "build_gpt_model",
    "export_hf_state_dict",
    "hf_to_transformer_config",
    "load_hf_checkpoint",
    "load_hf_state_dict",
    "load_hf_weights",
]


def hf_to_transformer_config(
    hf_config: Any | Mapping[str, Any], *, params_dtype: torch.dtype = torch.float32, **overrides: Any
) -> TransformerConfig:
    """Megatron `TransformerConfig` equivalent to an HF Qwen2/Llama/Qwen3 config.

    Fusions that need CUDA kernels are off and dropout is 0; `overrides` (any TransformerConfig
    field, e.g. tensor_model_parallel_size) are applied last.
    """
    shape = read_decoder_shape(hf_config)
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        transformer_impl="local",  # override with "transformer_engine" for Megatron's TE spec (build_gpt_model)
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    hf_config: Any | Mapping[str, Any],
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    **overrides: Any,
) -> GPTModel:
    """This rank's `GPTModel` stage (TP/PP position from `parallel_state`), randomly initialised;
    fill it with `load_hf_weights`. `overrides` go to `hf_to_transformer_config` (params_dtype too).
    With virtual pipeline stages (`parallel_state`'s virtual size), `vp_stage` picks which of this rank's model
    chunks to build: chunk c of pipeline rank r holds the layers of virtual stage c * PP + r.

    Needs `parallel.init_distributed` first. By default Megatron's local layer spec (no TransformerEngine)
    with `attention.PackedAttention` as its core attention: the model takes packed sequences
    (`packing.pack`, `attention.packed_seq_params`) and no attention mask. Its norms are `RMSNorm`, so
    `sequence_parallel=True` (an override) runs too. `transformer_impl="transformer_engine"` (an override)
    builds Megatron's TransformerEngine spec instead (fused norm+linear, TE's attention over the same packed
    sequences); it needs TransformerEngine, which this project's CPU install lacks, so that path is untested here.
    """
    shape = read_decoder_shape(hf_config)
    overrides.setdefault("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size())
    overrides.setdefault("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size())
    overrides.setdefault("virtual_pipeline_model_parallel_size",
                         parallel_state.get_virtual_pipeline_model_parallel_world_size())
    config = hf_to_transformer_config(hf_config, **overrides)
    if config.transformer_impl == "transformer_engine":
        spec, norm = _te_spec(shape)
    else:
        spec, norm = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm), RMSNorm
        layer, attn = spec.submodules, spec.submodules.self_attention.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
        if shape.qk_norm:
            attn.q_layernorm = attn.k_layernorm = RMSNorm
        attn.core_attention = PackedAttention
    block = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                       layer_norm=norm)
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=first if pre_process is None else pre_process,
        post_process=last if post_process is None else post_process,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=shape.rope_theta,
        vp_stage=vp_stage,
    )


def _te_spec(shape: Any) -> tuple[Any, type]:
    """Megatron's TransformerEngine layer spec and TE's norm (for the final norm); ValueError without TE."""
    try:
        import transformer_engine  # noqa: F401 - Megatron's TE spec silently lacks its classes without it
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    except ImportError as exc:
        raise ValueError(f"override_transformer_config.transformer_impl=transformer_engine needs TransformerEngine "
                         f"({exc}); install a build for this torch and CUDA, or drop the key (local spec)") from exc
    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm), TENorm


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built the way Megatron builds a norm (the local spec's own refuses sequence parallelism):
    on the rank's device, in the parameters' dtype.

    With sequence parallelism each TP rank normalises its own slice of the sequence, so the weight is marked
    `sequence_parallel` and Megatron's `finalize_model_grads` sums its gradient over the TP group.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()  # as Megatron's layers
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def load_hf_checkpoint(path: str | Path, trust_remote_code: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, state dict) of a local HF checkpoint dir: config.json (read with the checkpoint's own code when
    `trust_remote_code`) + safetensors weights."""
    from transformers import AutoConfig

    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root}/config.json not found: pass an HF checkpoint directory")
    return AutoConfig.from_pretrained(root, trust_remote_code=trust_remote_code), load_hf_state_dict(root)


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of `model.safetensors` or of every shard in `model.safetensors.index.json`,
    on the CPU in their stored dtype (no transformers import: cheap in worker processes)."""
    from safetensors.torch import load_file

    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{root} has neither model.safetensors nor model.safetensors.index.json; "
            "save the checkpoint with save_pretrained(safe_serialization=True)"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(root / name, device="cpu"))
    logger.info("loaded %d tensors from %s (%d file(s))", len(state), root, len(files))
    return state
