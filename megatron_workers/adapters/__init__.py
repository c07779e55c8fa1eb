"""HF checkpoints <-> Megatron-Core `GPTModel` shards, for any TP x PP layout, one adapter per architecture.

Each architecture module (`qwen2`, `llama`, `qwen3`) says which config fields it refuses and which
optional tensors it has (QKV bias, q/k norms) by reading the config into a `base.DecoderShape`;
`base` holds the name rules and the exact TP layout conversions they share. This module picks
the adapter from the config's `architectures` / `model_type` and runs the load and export
collectives. Anything an adapter cannot express (rope scaling, sliding windows, biases Megatron's
GPT layer has no place for) is refused by `read_decoder_shape` with the field's name.

A model built with another pipeline split than `model.build_gpt_model`'s is refused when loading
or exporting. Under virtual pipeline stages a rank holds several model chunks; the exporting functions
take the rank's list of chunks (or one GPTModel).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from megatron_workers.adapters import llama, qwen2, qwen3
from megatron_workers.adapters.base import (
    DecoderShape,
    config_dict,
    export_plan,
    hf_to_shard,
    local_rules,
    shard_pieces,
    shards_to_hf,
)
from megatron_workers.adapters.base import hf_tensor_shapes as _shape_tensor_shapes

Model = torch.nn.Module | Sequence[torch.nn.Module]
"""A GPTModel (maybe wrapped), or a rank's list of model chunks under virtual pipeline stages."""

ADAPTERS = {a.ARCHITECTURE: a for a in (qwen2, llama, qwen3)}
"""HF architecture name -> its adapter module."""

__all__ = [
    "ADAPTERS",
    "DecoderShape",
    "check_hf_state_dict",
    "export_hf_state_dict",
    "hf_tensor_shapes",
    "is_te_layout",
    "iter_hf_tensors",
    "iter_stage_hf_tensors",
    "load_hf_weights",
    "place_stage_shards",
    "read_decoder_shape",
    "stage_hf_tensor_shapes",
]


def read_decoder_shape(hf_config: Any | Mapping[str, Any]) -> DecoderShape:
    """Read and check an HF config with its architecture's adapter; raises ValueError naming the first
    unsupported field."""
    cfg = config_dict(hf_config)
    archs = cfg.get("architectures") or []
    unsupported = [a for a in archs if a not in ADAPTERS]
    if unsupported:
        raise ValueError(f"config field architectures={archs} is not supported; supported: {sorted(ADAPTERS)}")
    by_type = {a.MODEL_TYPE: a for a in ADAPTERS.values()}
    model_type = cfg.get("model_type")
    if model_type not in by_type:
        raise ValueError(f"config field model_type={model_type!r} is not supported; supported: {sorted(by_type)}")
    return by_type[model_type].read_shape(cfg)


def hf_tensor_shapes(hf_config: Any | Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF state dict (lm_head only when untied) and its shape, in HF order."""
    return _shape_tensor_shapes(read_decoder_shape(hf_config))


def stage_hf_tensor_shapes(hf_config: Any, stage: int, pp: int, vpp: int = 1) -> dict[str, tuple[int, ...]]:
    """The HF tensors pipeline stage `stage` of `pp` (with `vpp` model chunks each) exports (`iter_stage_hf_tensors`),
    in order, with shapes."""
    shape = read_decoder_shape(hf_config)
    shapes = _shape_tensor_shapes(shape)
    return {n: shapes[n] for v, rule in export_plan(shape, pp * vpp) if v % pp == stage for n in rule.hf_names}


def _position() -> tuple[int, int, int, int]:
    """(tp size, tp rank, pp size, pp stage) of this rank, from parallel_state."""
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )


def _chunk_params(model: Model, shape: DecoderShape
                  ) -> tuple[dict[int, dict[str, torch.nn.Parameter]], int, bool]:
    """This rank's model chunks' parameters by local name, keyed by virtual stage; the number of virtual stages; and
    whether the chunks were built from Megatron's TransformerEngine spec (`is_te_layout`).

    `model`: a GPTModel (maybe wrapped), or this rank's list of chunks under virtual pipeline stages, where chunk c
    of pipeline rank r is virtual stage c * PP + r (Megatron's interleaved layout). Checks each chunk holds its
    stage's layers.
    """
    _, _, pp, stage = _position()
    stages = pp * (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1)
    per_stage = shape.num_layers // stages
    out = {}
    for chunk in model if isinstance(model, Sequence) else [model]:
        gpt = unwrap_model(chunk)
        chunk_index = gpt.vp_stage or 0
        v = chunk_index * pp + stage
        got = [layer.layer_number for layer in gpt.decoder.layers]
        want = list(range(v * per_stage + 1, (v + 1) * per_stage + 1))
        if got != want:
            raise ValueError(
                f"pipeline stage {v}/{stages} (model chunk {chunk_index} of pipeline rank {stage}) holds layers {got} "
                f"(1-based), expected {want}: "
                "build the model with build_gpt_model (even pipeline split)"
            )
        out[v] = dict(gpt.named_parameters())
    return out, stages, any(is_te_layout(params) for params in out.values())


def is_te_layout(params: Mapping[str, torch.nn.Parameter]) -> bool:
    """Whether the model was built from Megatron's TransformerEngine spec (its pre-norms live in the linear layers)."""
    return any(name.endswith(".layer_norm_weight") for name in params)


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
    """Copy this rank's TP/PP shards of an HF state dict into `model` (a GPTModel, maybe wrapped; one model chunk).

    Raises ValueError naming every missing HF tensor or wrong shape (expected vs got) this rank
    needs, before copying anything. Values are cast to the parameters' dtype.
    """
    shape = read_decoder_shape(hf_config)
    tp, tp_rank, _, _ = _position()
    chunks, stages, te = _chunk_params(model, shape)
    (v, params), = chunks.items()
    rules = local_rules(shape, v, stages, te)
    check_hf_state_dict(hf_state_dict, hf_config, names=[n for r in rules for n in r.hf_names])
    unmapped = set(params) - {r.megatron_name for r in rules}
    unbuilt = {r.megatron_name for r in rules} - set(params)
    if unmapped or unbuilt:
        raise ValueError(
            f"GPTModel parameters do not match the {shape.model_type} layout: no HF source for {sorted(unmapped)}, "
            f"not built: {sorted(unbuilt)}; build the model with build_gpt_model"
        )
    with torch.no_grad():
        for rule in rules:
            shard = hf_to_shard(rule, [hf_state_dict[n] for n in rule.hf_names], shape, tp, tp_rank)
            param = params[rule.megatron_name]
            if param.shape != shard.shape:
                raise ValueError(
                    f"{rule.megatron_name} on tp rank {tp_rank} has shape {tuple(param.shape)} but "
                    f"{'+'.join(rule.hf_names)} gives {tuple(shard.shape)}; the model was built for another config"
                )
            param.copy_(shard)


def iter_hf_tensors(model: Model, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every HF tensor, in HF order, on every rank.

    Collective: all TP x PP ranks of the model-parallel group must iterate in lockstep. The owning
    stage all-gathers the TP shards; the full tensor is then broadcast over the pipeline group, so
    memory per step is one full tensor. Dtype is the parameters' dtype.
    """
    shape = read_decoder_shape(hf_config)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    tp, _, pp, _ = _position()
    chunks, stages, te = _chunk_params(model, shape)
    hf_shapes = _shape_tensor_shapes(shape)
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group) if pp > 1 else []
    some_param = next(iter(next(iter(chunks.values())).values()))  # dtype and device of the received tensors
    for owner, rule in export_plan(shape, stages, te):
        if owner in chunks:
            local = chunks[owner][rule.megatron_name].detach()
            if rule.split == "replicated" or tp == 1:
                shards = [local]
            else:
                shards = [torch.empty_like(local) for _ in range(tp)]
                torch.distributed.all_gather(shards, local.contiguous(), group=tp_group)
            tensors = shards_to_hf(rule, shards, shape)
        else:
            like = {"dtype": some_param.dtype, "device": some_param.device}
            tensors = [torch.empty(hf_shapes[n], **like) for n in rule.hf_names]
        for name, tensor in zip(rule.hf_names, tensors, strict=True):
            tensor = tensor.contiguous()
            if pp > 1:
                torch.distributed.broadcast(tensor, src=pp_ranks[owner % pp], group=pp_group)
            yield name, tensor


def iter_stage_hf_tensors(
    model: Model, hf_config: Any, *, dst_tp_rank: int | None = 0, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the HF tensors this pipeline stage owns, in HF order.

    Collective over this stage's TP group only (stages export independently, nothing crosses the
    pipeline). Each tensor's shards are cast to `dtype` (default: the parameters') and gathered to
    TP rank `dst_tp_rank` (None: to every TP rank), one tensor at a time; the other TP ranks
    iterate without yielding. Replicated tensors are not communicated.
    """
    shape = read_decoder_shape(hf_config)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp, tp_rank, _, _ = _position()
    chunks, stages, te = _chunk_params(model, shape)
    receives = dst_tp_rank is None or tp_rank == dst_tp_rank
    dst = None if dst_tp_rank is None else torch.distributed.get_process_group_ranks(tp_group)[dst_tp_rank]
    for owner, rule in export_plan(shape, stages, te):
        if owner not in chunks:
            continue
        param = chunks[owner][rule.megatron_name]
        local = param.detach().to(dtype or param.dtype).contiguous()
        if rule.split == "replicated" or tp == 1:
            shards = [local]
        elif dst is None:
            shards = [torch.empty_like(local) for _ in range(tp)]
            torch.distributed.all_gather(shards, local, group=tp_group)
        else:
            shards = [torch.empty_like(local) for _ in range(tp)] if receives else None
            torch.distributed.gather(local, shards, dst=dst, group=tp_group)
        if receives:
            for name, tensor in zip(rule.hf_names, shards_to_hf(rule, shards, shape), strict=True):
                yield name, tensor.contiguous()


def place_stage_shards(model: Model, hf_config: Any, views: Mapping[str, torch.Tensor], *,
                       replicated: bool) -> None:
    """Copy this TP rank's shard of each of this stage's parameters into the HF tensors of `views` it covers (HF
    name -> the full tensor's place, e.g. in a bucket every TP rank of the stage maps), cast to their dtype;
    tensors not in `views` are skipped. Replicated tensors are written only with `replicated` (by one rank). Not
    collective: the ranks together fill every view."""
    shape = read_decoder_shape(hf_config)
    tp, tp_rank, _, _ = _position()
    chunks, stages, te = _chunk_params(model, shape)
    hf_shapes = _shape_tensor_shapes(shape)
    for owner, rule in export_plan(shape, stages, te):
        if owner not in chunks or not any(n in views for n in rule.hf_names) or (rule.split == "replicated"
                                                                                 and not replicated):
            continue
        hf = [views[n] if n in views else torch.empty(hf_shapes[n], device="meta") for n in rule.hf_names]
        for i, view, part in shard_pieces(rule, chunks[owner][rule.megatron_name].detach(), hf, shape, tp, tp_rank):
            if rule.hf_names[i] in views:
                view.copy_(part)


def export_hf_state_dict(
    model: Model, hf_config: Any, *, dst_rank: int = 0
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
