"""What every architecture adapter shares: the decoder's shape, the HF <-> Megatron name rules and
the exact tensor layout conversions between HF tensors and Megatron's TP shards.

How HF tensors map onto Megatron's local-spec GPT layer (`get_gpt_layer_local_spec`):

- q/k/v projections are fused into `linear_qkv`, grouped per KV head: for each query group g the
  rows are [q heads of g, k head g, v head g]; TP then splits whole groups (dim 0). Same for a
  QKV bias (Qwen2).
- gate/up projections are fused into `linear_fc1`, but TP-shard-wise: rank r holds
  [gate rows of r; up rows of r], so the full Megatron tensor is not simply cat(gate, up).
- o_proj and down_proj are row-parallel (split along dim 1); embeddings and the output layer are
  vocab-parallel (split along dim 0); norms, q/k norms (Qwen3, Megatron's `qk_layernorm`) included,
  are replicated.
- With tied embeddings and PP > 1 the last stage holds its own copy of the embedding as
  `output_layer.weight`; it is loaded from `model.embed_tokens.weight` and never exported.
- Megatron's TransformerEngine spec (`get_gpt_layer_with_transformer_engine_spec`) fuses each
  layer's two pre-norms into the following linear layer: `input_layernorm.weight` becomes
  `self_attention.linear_qkv.layer_norm_weight` and `pre_mlp_layernorm.weight` becomes
  `mlp.linear_fc1.layer_norm_weight` (`te=True` in the plans below); every other name is the same.

Pipeline stages (virtual ones included) hold equal numbers of layers (`parallel.validate_layout` enforces
divisibility).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class DecoderShape:
    """The dimensions of a supported HF decoder, read once from its config by its adapter."""

    model_type: str  # "qwen2" | "llama" | "qwen3"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # intermediate_size
    num_heads: int
    num_kv_heads: int
    head_dim: int  # Megatron's kv_channels; Qwen3's is not hidden_size / num_heads
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v (not o); Llama, Qwen3: none
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE (Megatron's qk_layernorm)


def config_dict(hf_config: Any | Mapping[str, Any]) -> dict[str, Any]:
    """A transformers PretrainedConfig or a dict -> a plain dict (with the attributes to_dict may drop)."""
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


def refuse_sliding_window(cfg: Mapping[str, Any]) -> None:
    """Qwen2/Qwen3 configs: only full attention in every layer."""
    if cfg.get("use_sliding_window"):
        raise ValueError("config field use_sliding_window=True is not supported; set it to false")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config field layer_types={layer_types} is not supported (full attention only)")


def refuse_true(cfg: Mapping[str, Any], fields: tuple[str, ...], why: str) -> None:
    """Raise naming the first of `fields` set in the config."""
    for field in fields:
        if cfg.get(field):
            raise ValueError(f"config field {field}=True is not supported ({why}); use a checkpoint without it")


def decoder_shape(cfg: Mapping[str, Any], *, qkv_bias: bool, qk_norm: bool) -> DecoderShape:
    """The checks and fields every SwiGLU + RMSNorm + RoPE decoder shares; errors name the field."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field hidden_act={cfg['hidden_act']!r} is not supported (SwiGLU needs 'silu')")
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
        model_type=cfg["model_type"],
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
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
    )


# ---------------------------------------------------------------------------------------------
# The name/shape plan: which Megatron parameter holds which HF tensors, split how.

Split = Literal["replicated", "dim0", "dim1", "qkv", "fc1"]


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter (local name on its stage) <- the HF tensors it holds, split how over TP."""

    megatron_name: str
    hf_names: tuple[str, ...]
    split: Split


def hf_tensor_shapes(s: DecoderShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF state dict (lm_head only when untied) and its shape, in HF order."""
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
        if s.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (s.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (s.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (s.ffn_hidden_size, h)
        shapes[p + "mlp.up_proj.weight"] = (s.ffn_hidden_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, s.ffn_hidden_size)
    shapes["model.norm.weight"] = (h,)
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, h)
    return shapes


def _layer_rules(local: int, layer: int, s: DecoderShape, te: bool) -> list[Rule]:
    m, p = f"decoder.layers.{local}.", f"model.layers.{layer}."
    qkv = tuple(p + f"self_attn.{x}_proj" for x in "qkv")
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    pre_mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    rules = [
        Rule(m + input_norm, (p + "input_layernorm.weight",), "replicated"),
        Rule(m + "self_attention.linear_qkv.weight", tuple(n + ".weight" for n in qkv), "qkv"),
    ]
    if s.qkv_bias:
        rules.append(Rule(m + "self_attention.linear_qkv.bias", tuple(n + ".bias" for n in qkv), "qkv"))
    if s.qk_norm:
        rules += [
            Rule(m + "self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",), "replicated"),
            Rule(m + "self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",), "replicated"),
        ]
    return rules + [
        Rule(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), "dim1"),
        Rule(m + pre_mlp_norm, (p + "post_attention_layernorm.weight",), "replicated"),
        Rule(m + "mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"),
        Rule(m + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "dim1"),
    ]


def export_plan(s: DecoderShape, stages: int, te: bool = False) -> list[tuple[int, Rule]]:
    """(owning stage, rule) for every exported parameter, in HF order, the layers split evenly over `stages`
    pipeline stages (virtual ones included: PP x model chunks per rank); `te`: the TransformerEngine spec's names
    (norms fused into the next linear layer), else the local spec's."""
    per_stage = s.num_layers // stages
    plan = [(0, Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "dim0"))]
    for layer in range(s.num_layers):
        stage = layer // per_stage
        plan += [(stage, r) for r in _layer_rules(layer - stage * per_stage, layer, s, te)]
    plan.append((stages - 1, Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")))
    if not s.tie_word_embeddings:
        plan.append((stages - 1, Rule("output_layer.weight", ("lm_head.weight",), "dim0")))
    return plan


def local_rules(s: DecoderShape, stage: int, stages: int, te: bool = False) -> list[Rule]:
    """The rules for the parameters the given stage of `stages` holds (tied output copy included)."""
    rules = [r for owner, r in export_plan(s, stages, te) if owner == stage]
    if s.tie_word_embeddings and stages > 1 and stage == stages - 1:
        rules.append(Rule("output_layer.weight", ("model.embed_tokens.weight",), "dim0"))
    return rules


# ---------------------------------------------------------------------------------------------
# Tensor layout conversions (exact: only views, chunks and concatenations).


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: DecoderShape) -> torch.Tensor:
    """HF q/k/v (heads*d, ...) -> Megatron's per-KV-group [q_g, k_g, v_g] layout ((nh+2nkv)*d, ...)."""
    rest = q.shape[1:]
    g = s.num_kv_heads
    parts = (q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def hf_to_shard(rule: Rule, tensors: list[torch.Tensor], s: DecoderShape, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s shard of the Megatron parameter `rule` fills, from its HF tensors."""
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


def shard_pieces(rule: Rule, shard: torch.Tensor, hf: list[torch.Tensor], s: DecoderShape, tp: int,
                 rank: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Where TP rank `rank`'s shard of `rule` lies in the full HF tensors `hf` (`rule.hf_names` order; meta tensors
    stand for ones that are elsewhere): `(index in hf, view of hf[index], the part of shard that fills it)`, views
    only. Copying every rank's parts into their views rebuilds what `hf_to_shard` split."""
    if rule.split == "replicated":
        return [(0, hf[0], shard)]
    if rule.split in ("dim0", "dim1"):
        return [(0, hf[0].chunk(tp, dim=0 if rule.split == "dim0" else 1)[rank], shard)]
    if rule.split == "qkv":  # the shard holds kv groups [rank*g, (rank+1)*g), each [q_g, k_g, v_g]
        rest, g = shard.shape[1:], s.num_kv_heads // tp
        per_group = s.num_heads // s.num_kv_heads * s.head_dim
        parts = torch.split(shard.reshape(g, per_group + 2 * s.head_dim, *rest),
                            [per_group, s.head_dim, s.head_dim], dim=1)
        return [(i, t.reshape(s.num_kv_heads, -1, *rest)[rank * g:(rank + 1) * g], part)
                for i, (t, part) in enumerate(zip(hf, parts))]
    gate, up = shard.chunk(2, dim=0)  # fc1: [gate_r; up_r]
    return [(0, hf[0].chunk(tp, dim=0)[rank], gate), (1, hf[1].chunk(tp, dim=0)[rank], up)]


def shards_to_hf(rule: Rule, shards: list[torch.Tensor], s: DecoderShape) -> list[torch.Tensor]:
    """Inverse of `hf_to_shard`: every TP rank's shard (rank order) -> the HF tensors, in `rule.hf_names` order."""
    if rule.split == "replicated":
        return [shards[0]]
    tp, shape = len(shards), shards[0].shape
    if rule.split == "dim0":
        shapes = [(shape[0] * tp, *shape[1:])]
    elif rule.split == "dim1":
        shapes = [(shape[0], shape[1] * tp)]
    elif rule.split == "qkv":
        shapes = [(n * s.head_dim, *shape[1:]) for n in (s.num_heads, s.num_kv_heads, s.num_kv_heads)]
    else:
        shapes = [(shape[0] // 2 * tp, *shape[1:])] * 2
    hf = [shards[0].new_empty(x) for x in shapes]
    for rank, shard in enumerate(shards):
        for _, view, part in shard_pieces(rule, shard, hf, s, tp, rank):
            view.copy_(part)
    return hf
