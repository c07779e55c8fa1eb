"""HF Qwen2/Llama checkpoints <-> Megatron-Core `GPTModel` shards, for any TP x PP layout.

What it covers: decoder-only Qwen2 and Llama models (GQA, QKV bias, tied or untied embeddings,
RMSNorm, SwiGLU, plain RoPE with any theta). Anything else (rope scaling, sliding windows, biases
Megatron's GPT layer cannot express) is refused by `read_decoder_shape` with the field's name.

How HF tensors map onto Megatron's local-spec GPT layer (`get_gpt_layer_local_spec`):

- q/k/v projections are fused into `linear_qkv`, grouped per KV head: for each query group g the
  rows are [q heads of g, k head g, v head g]; TP then splits whole groups (dim 0). Same for the
  Qwen2 QKV bias.
- gate/up projections are fused into `linear_fc1`, but TP-shard-wise: rank r holds
  [gate rows of r; up rows of r], so the full Megatron tensor is not simply cat(gate, up).
- o_proj and down_proj are row-parallel (split along dim 1); embeddings and the output layer are
  vocab-parallel (split along dim 0); norms are replicated.
- With tied embeddings and PP > 1 the last stage holds its own copy of the embedding as
  `output_layer.weight`; it is loaded from `model.embed_tokens.weight` and never exported.

Pipeline stages hold equal numbers of layers (`parallel.validate_layout` enforces divisibility);
a model built with another split is refused when loading or exporting.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model

try:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
except OSError as exc:  # megatron-core's attention imports flash_mla, which needs libcuda
    raise ImportError(
        f"megatron-core's GPT model could not be imported ({exc}); on a machine without a GPU call "
        "megatron_workers.cpu_compat.apply_cpu_compat() at the process's start, before importing "
        "megatron_workers.model"
    ) from exc

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


@dataclass(frozen=True)
class DecoderShape:
    """The dimensions of a supported HF decoder, read once from its config."""

    model_type: str  # "qwen2" | "llama"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # intermediate_size
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v (not o); Llama: none


def _config_dict(hf_config: Any | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        cfg = hf_config.to_dict()
        for key in ("head_dim", "tie_word_embeddings"):  # attributes to_dict may leave out
            if key not in cfg and hasattr(hf_config, key):
                cfg[key] = getattr(hf_config, key)
        return cfg
    raise TypeError(f"hf_config must be a transformers PretrainedConfig or a dict, got {type(hf_config)!r}")


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    """rope theta from `rope_parameters` (transformers >= 5) or `rope_theta`; refuses scaling."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(
                f"config field {field}.rope_type={kind!r} is not supported (only plain RoPE); "
                "use a checkpoint without rope scaling"
            )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError("config has neither rope_parameters.rope_theta nor rope_theta; add the model's RoPE base")
    return float(theta)


def read_decoder_shape(hf_config: Any | Mapping[str, Any]) -> DecoderShape:
    """Read and check an HF config; raises ValueError naming the first unsupported field."""
    cfg = _config_dict(hf_config)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if unsupported:
        raise ValueError(
            f"config field architectures={archs} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(
            f"config field model_type={model_type!r} is not supported; "
            f"supported: {sorted(set(SUPPORTED_ARCHITECTURES.values()))}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field hidden_act={cfg['hidden_act']!r} is not supported (SwiGLU needs 'silu')")
    if model_type == "qwen2":
        if cfg.get("use_sliding_window"):
            raise ValueError("config field use_sliding_window=True is not supported; set it to false")
        layer_types = cfg.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config field layer_types={layer_types} is not supported (full attention only)")
    else:
        for field in ("attention_bias", "mlp_bias"):
            if cfg.get(field):
                raise ValueError(
                    f"config field {field}=True is not supported (Megatron's GPT layer has no "
                    "o_proj/MLP bias without biasing every linear layer)"
                )
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(cfg.get(field), int) or cfg[field] <= 0:
            raise ValueError(f"config field {field}={cfg.get(field)!r} must be a positive integer")
    num_heads = cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(
            f"config field num_key_value_heads={num_kv_heads} does not divide num_attention_heads={num_heads}"
        )
    return DecoderShape(
        model_type=model_type,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
    )


def hf_to_transformer_config(
    hf_config: Any | Mapping[str, Any], *, params_dtype: torch.dtype = torch.float32, **overrides: Any
) -> TransformerConfig:
    """Megatron `TransformerConfig` equivalent to an HF Qwen2/Llama config.

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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
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
    **overrides: Any,
) -> GPTModel:
    """This rank's `GPTModel` stage (TP/PP position from `parallel_state`), randomly initialised;
    fill it with `load_hf_weights`. `overrides` go to `hf_to_transformer_config` (params_dtype too).

    Needs `parallel.init_distributed` first. Uses Megatron's local layer spec (no TransformerEngine).
    """
    shape = read_decoder_shape(hf_config)
    overrides.setdefault("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size())
    overrides.setdefault("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size())
    config = hf_to_transformer_config(hf_config, **overrides)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=parallel_state.is_pipeline_last_stage() if post_process is None else post_process,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=shape.rope_theta,
    )


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """`attention_mask` (b, s) of 1/0 -> the GPTModel's (b, 1, s, s) bool mask, True where attention
    is blocked: a later position (causal) or a padding key."""
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()  # (s, s)
    allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)  # (b, s, s)
    return ~allowed.unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# The name/shape plan: which Megatron parameter holds which HF tensors, split how.

Split = Literal["replicated", "dim0", "dim1", "qkv", "fc1"]


@dataclass(frozen=True)
class _Rule:
    megatron_name: str  # local parameter name on the owning stage
    hf_names: tuple[str, ...]
    split: Split


def hf_tensor_shapes(hf_config: Any | Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF state dict (lm_head only when untied) and its shape, in HF order."""
    s = read_decoder_shape(hf_config)
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, h)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if s.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (s.ffn_hidden_size, h)
        shapes[p + "mlp.up_proj.weight"] = (s.ffn_hidden_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, s.ffn_hidden_size)
    shapes["model.norm.weight"] = (h,)
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, h)
    return shapes


def _layer_rules(local: int, layer: int, shape: DecoderShape) -> list[_Rule]:
    m, p = f"decoder.layers.{local}.", f"model.layers.{layer}."
    qkv = tuple(p + f"self_attn.{x}_proj" for x in "qkv")
    rules = [
        _Rule(m + "input_layernorm.weight", (p + "input_layernorm.weight",), "replicated"),
        _Rule(m + "self_attention.linear_qkv.weight", tuple(n + ".weight" for n in qkv), "qkv"),
    ]
    if shape.qkv_bias:
        rules.append(_Rule(m + "self_attention.linear_qkv.bias", tuple(n + ".bias" for n in qkv), "qkv"))
    return rules + [
        _Rule(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), "dim1"),
        _Rule(m + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), "replicated"),
        _Rule(m + "mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"),
        _Rule(m + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "dim1"),
    ]


def _export_plan(shape: DecoderShape, pp: int) -> list[tuple[int, _Rule]]:
    """(owning pipeline stage, rule) for every exported parameter, in HF order."""
    per_stage = shape.num_layers // pp
    plan = [(0, _Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "dim0"))]
    for layer in range(shape.num_layers):
        stage = layer // per_stage
        plan += [(stage, r) for r in _layer_rules(layer - stage * per_stage, layer, shape)]
    plan.append((pp - 1, _Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")))
    if not shape.tie_word_embeddings:
        plan.append((pp - 1, _Rule("output_layer.weight", ("lm_head.weight",), "dim0")))
    return plan


def _local_rules(shape: DecoderShape, stage: int, pp: int) -> list[_Rule]:
    """The rules for the parameters the given pipeline stage holds (tied output copy included)."""
    rules = [r for s, r in _export_plan(shape, pp) if s == stage]
    if shape.tie_word_embeddings and pp > 1 and stage == pp - 1:
        rules.append(_Rule("output_layer.weight", ("model.embed_tokens.weight",), "dim0"))
    return rules


def _position() -> tuple[int, int, int, int]:
    """(tp size, tp rank, pp size, pp stage) of this rank, from parallel_state."""
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )


def _unwrapped_params(
    model: torch.nn.Module, shape: DecoderShape, stage: int, pp: int
) -> dict[str, torch.nn.Parameter]:
    """The GPTModel's parameters by local name, after checking its layers are this stage's."""
    gpt = unwrap_model(model)
    per_stage = shape.num_layers // pp
    got = [layer.layer_number for layer in gpt.decoder.layers]
    want = list(range(stage * per_stage + 1, (stage + 1) * per_stage + 1))
    if got != want:
        raise ValueError(
            f"pipeline stage {stage}/{pp} holds layers {got} (1-based), expected {want}: "
            "build the model with build_gpt_model (even pipeline split, no virtual stages)"
        )
    return dict(gpt.named_parameters())


# ---------------------------------------------------------------------------------------------
# Tensor layout conversions (exact: only views, chunks and concatenations).


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: DecoderShape) -> torch.Tensor:
    """HF q/k/v (heads*d, ...) -> Megatron's per-KV-group [q_g, k_g, v_g] layout ((nh+2nkv)*d, ...)."""
    rest = q.shape[1:]
    g = s.num_kv_heads
    parts = (q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, s: DecoderShape) -> list[torch.Tensor]:
    """Inverse of `_interleave_qkv`."""
    rest = qkv.shape[1:]
    per_group = s.num_heads // s.num_kv_heads * s.head_dim
    grouped = qkv.reshape(s.num_kv_heads, per_group + 2 * s.head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group, s.head_dim, s.head_dim], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def _hf_to_shard(rule: _Rule, tensors: list[torch.Tensor], s: DecoderShape, tp: int, rank: int) -> torch.Tensor:
    if rule.split == "replicated":
        return tensors[0]
    if rule.split == "dim0":
        return tensors[0].chunk(tp, dim=0)[rank]
    if rule.split == "dim1":
        return tensors[0].chunk(tp, dim=1)[rank]
    if rule.split == "qkv":
        return _interleave_qkv(*tensors, s).chunk(tp, dim=0)[rank]
    gate, up = tensors  # fc1
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])


def _shards_to_hf(rule: _Rule, shards: list[torch.Tensor], s: DecoderShape) -> list[torch.Tensor]:
    if rule.split == "replicated":
        return [shards[0]]
    if rule.split == "dim0":
        return [torch.cat(shards, dim=0)]
    if rule.split == "dim1":
        return [torch.cat(shards, dim=1)]
    if rule.split == "qkv":
        return _split_qkv(torch.cat(shards, dim=0), s)
    halves = [shard.chunk(2, dim=0) for shard in shards]  # fc1: each rank holds [gate_r; up_r]
    return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]


# ---------------------------------------------------------------------------------------------
# Public conversion API.


def check_hf_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor], hf_config: Any, *, names: Iterable[str] | None = None
) -> None:
    """Raise one ValueError naming every missing tensor and wrong shape (expected vs got).

    names: the HF tensors to check (default: all of `hf_tensor_shapes`). Extra tensors are ignored.
    """
    expected = hf_tensor_shapes(hf_config)
    problems = []
    for name in dict.fromkeys(expected if names is None else names):
        if name not in hf_state_dict:
            problems.append(f"missing tensor {name} (expected shape {expected[name]})")
        elif tuple(hf_state_dict[name].shape) != expected[name]:
            problems.append(f"tensor {name}: expected shape {expected[name]}, got {tuple(hf_state_dict[name].shape)}")
    if problems:
        raise ValueError("HF checkpoint does not match its config: " + "; ".join(problems))


def load_hf_weights(model: torch.nn.Module, hf_state_dict: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Copy this rank's TP/PP shards of an HF state dict into `model` (a GPTModel, maybe wrapped).

    Raises ValueError naming every missing HF tensor or wrong shape (expected vs got) this rank
    needs, before copying anything. Values are cast to the parameters' dtype.
    """
    shape = read_decoder_shape(hf_config)
    tp, tp_rank, pp, stage = _position()
    params = _unwrapped_params(model, shape, stage, pp)
    rules = _local_rules(shape, stage, pp)
    check_hf_state_dict(hf_state_dict, hf_config, names=[n for r in rules for n in r.hf_names])
    unmapped = set(params) - {r.megatron_name for r in rules}
    unbuilt = {r.megatron_name for r in rules} - set(params)
    if unmapped or unbuilt:
        raise ValueError(
            f"GPTModel parameters do not match the Qwen2/Llama layout: no HF source for {sorted(unmapped)}, "
            f"not built: {sorted(unbuilt)}; build the model with build_gpt_model"
        )
    with torch.no_grad():
        for rule in rules:
            shard = _hf_to_shard(rule, [hf_state_dict[n] for n in rule.hf_names], shape, tp, tp_rank)
            param = params[rule.megatron_name]
            if param.shape != shard.shape:
                raise ValueError(
                    f"{rule.megatron_name} on tp rank {tp_rank} has shape {tuple(param.shape)} but "
                    f"{'+'.join(rule.hf_names)} gives {tuple(shard.shape)}; the model was built for another config"
                )
            param.copy_(shard)


def iter_hf_tensors(model: torch.nn.Module, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every HF tensor, in HF order, on every rank.

    Collective: all TP x PP ranks of the model-parallel group must iterate in lockstep. The owning
    stage all-gathers the TP shards; the full tensor is then broadcast over the pipeline group, so
    memory per step is one full tensor. Dtype is the parameters' dtype.
    """
    shape = read_decoder_shape(hf_config)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    tp, _, pp, stage = _position()
    params = _unwrapped_params(model, shape, stage, pp)
    hf_shapes = hf_tensor_shapes(hf_config)
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group) if pp > 1 else []
    some_param = next(iter(params.values()))
    for owner, rule in _export_plan(shape, pp):
        if owner == stage:
            local = params[rule.megatron_name].detach()
            if rule.split == "replicated" or tp == 1:
                shards = [local]
            else:
                shards = [torch.empty_like(local) for _ in range(tp)]
                torch.distributed.all_gather(shards, local.contiguous(), group=tp_group)
            tensors = _shards_to_hf(rule, shards, shape)
        else:
            like = dict(dtype=some_param.dtype, device=some_param.device)
            tensors = [torch.empty(hf_shapes[n], **like) for n in rule.hf_names]
        for name, tensor in zip(rule.hf_names, tensors, strict=True):
            tensor = tensor.contiguous()
            if pp > 1:
                torch.distributed.broadcast(tensor, src=pp_ranks[owner], group=pp_group)
            yield name, tensor


def stage_hf_tensor_shapes(hf_config: Any, stage: int, pp: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors pipeline stage `stage` of `pp` exports (`iter_stage_hf_tensors`), in order, with shapes."""
    shapes = hf_tensor_shapes(hf_config)
    return {n: shapes[n] for s, rule in _export_plan(read_decoder_shape(hf_config), pp) if s == stage
            for n in rule.hf_names}


def iter_stage_hf_tensors(
    model: torch.nn.Module, hf_config: Any, *, dst_tp_rank: int | None = 0, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the HF tensors this pipeline stage owns, in HF order.

    Collective over this stage's TP group only (stages export independently, nothing crosses the
    pipeline). Each tensor's shards are cast to `dtype` (default: the parameters') and gathered to
    TP rank `dst_tp_rank` (None: to every TP rank), one tensor at a time; the other TP ranks
    iterate without yielding. Replicated tensors are not communicated.
    """
    shape = read_decoder_shape(hf_config)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp, tp_rank, pp, stage = _position()
    params = _unwrapped_params(model, shape, stage, pp)
    receives = dst_tp_rank is None or tp_rank == dst_tp_rank
    dst = None if dst_tp_rank is None else torch.distributed.get_process_group_ranks(tp_group)[dst_tp_rank]
    for owner, rule in _export_plan(shape, pp):
        if owner != stage:
            continue
        local = params[rule.megatron_name].detach().to(dtype or params[rule.megatron_name].dtype).contiguous()
        if rule.split == "replicated" or tp == 1:
            shards = [local]
        elif dst is None:
            shards = [torch.empty_like(local) for _ in range(tp)]
            torch.distributed.all_gather(shards, local, group=tp_group)
        else:
            shards = [torch.empty_like(local) for _ in range(tp)] if receives else None
            torch.distributed.gather(local, shards, dst=dst, group=tp_group)
        if receives:
            for name, tensor in zip(rule.hf_names, _shards_to_hf(rule, shards, shape), strict=True):
                yield name, tensor.contiguous()


def export_hf_state_dict(
    model: torch.nn.Module, hf_config: Any, *, dst_rank: int = 0
) -> dict[str, torch.Tensor] | None:
    """The full HF state dict (TP/PP shards gathered) on global rank `dst_rank`, None elsewhere.

    Collective over all model-parallel ranks (see `iter_hf_tensors`). Tensors are CPU clones.
    """
    keep = torch.distributed.get_rank() == dst_rank
    out = {}
    for name, tensor in iter_hf_tensors(model, hf_config):
        if keep:
            out[name] = tensor.detach().to("cpu", copy=True)
    return out if keep else None


def load_hf_checkpoint(path: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, state dict) of a local HF checkpoint dir: config.json + safetensors weights."""
    from transformers import AutoConfig

    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root}/config.json not found: pass an HF checkpoint directory")
    return AutoConfig.from_pretrained(root), load_hf_state_dict(root)


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
