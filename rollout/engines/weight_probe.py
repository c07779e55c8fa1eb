"""The engine side of `rollout.check_weights`: per-HF-tensor checksums of the weights an engine serves.

SGLang keeps its weights in the scheduler processes (one per engine TP rank), fused and sharded
(`qkv_proj`, `gate_up_proj`, vocab-parallel embeddings padded to a multiple of 64). `report` runs
there, through SGLang's custom-weight-loader hook (`load_format=LOADER` on a tensor update that
carries no weights), undoes the fusion and the padding, and writes one JSON file per TP rank:
`{hf_name: [sum, abs_sum, sum_of_squares, replicas]}` in float64 over that rank's part, where
`replicas` says on how many TP ranks the same values sit (norms: all of them; k/v heads: SGLang's
`num_kv_head_replicas`). `combine` adds the parts up, counting each replicated copy once, so the
result equals the same statistics of the full HF tensor, whatever the engine's TP size.

Sums are cheap and layout-free, and catch a stale or corrupted tensor; they do not catch values
permuted within one tensor (the greedy-parity tests cover layout).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the driver imports `mismatches` without torch
    import torch

#: Dotted path SGLang imports as a custom weight loader (registered by `SGLangEngine` at start).
LOADER = "rollout.engines.weight_probe.report"
_PREFIX = "__polyturn_probe__:"

logger = logging.getLogger(__name__)


def probe_dir_name(out_dir: str) -> str:
    """The tensor name that tells `report` where to write (the request carries no weights)."""
    return _PREFIX + out_dir


def tensor_stats(t: torch.Tensor, chunk: int = 1 << 20) -> list[float]:
    """[sum, abs_sum, sum_of_squares] of a tensor in float64, a chunk at a time (no float64 copy of it).
    The senders compute the same (`megatron_workers.weights.tensor_stats`; the packages share no code)."""
    acc = [0.0, 0.0, 0.0]
    flat = t.detach().reshape(-1)
    for i in range(0, flat.numel(), chunk):
        d = flat[i:i + chunk].double()
        acc[0] += float(d.sum())
        acc[1] += float(d.abs().sum())
        acc[2] += float((d * d).sum())
    return acc


def report(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang custom loader: write this TP rank's per-HF-tensor statistics; loads nothing.

    Never raises (an exception here would kill SGLang's scheduler): a failure is written to the
    rank's file instead, and `combine` raises it on the engine actor's side.
    """
    from sglang.srt.runtime_context import get_parallel

    name = named_tensors[0][0] if len(named_tensors) == 1 else ""
    if not name.startswith(_PREFIX):
        logger.error("%s is the weight probe and loads no weights; ignored a request with %d tensors",
                     LOADER, len(named_tensors))
        return
    path = Path(name[len(_PREFIX):]) / f"rank-{os.getpid()}.json"
    try:
        tp = get_parallel().tp_size
        out: dict[str, Any] = {}
        for mod_name, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                for hf_name, part, replicas in _hf_parts(mod_name, pname, module, param, tp):
                    out[hf_name] = [*tensor_stats(part), float(replicas)]
    except Exception as e:  # noqa: BLE001 - reported to the caller through the file
        out = {"__error__": f"{type(e).__name__}: {e}"}
    path.write_text(json.dumps(out))


def _hf_parts(mod_name: str, pname: str, module: torch.nn.Module, param: torch.Tensor, tp: int):
    """(HF name, this rank's slice of it, replicas) for one SGLang parameter."""
    data = param.data
    prefix = mod_name.rsplit(".", 1)[0] + "." if "." in mod_name else ""
    if hasattr(module, "q_proj_shard_size"):  # QKVParallelLinear: rows [q | k | v] of this rank
        sizes = [module.q_proj_shard_size, module.kv_proj_shard_size, module.kv_proj_shard_size]
        kv_replicas = getattr(module, "num_kv_head_replicas", 1)
        for proj, part, rep in zip("qkv", data.split(sizes, dim=0), (1, kv_replicas, kv_replicas)):
            yield f"{prefix}{proj}_proj.{pname}", part, rep
        return
    if mod_name.endswith("gate_up_proj"):  # MergedColumnParallelLinear: rows [gate | up] of this rank
        gate, up = data.chunk(2, dim=0)
        yield f"{prefix}gate_proj.{pname}", gate, 1
        yield f"{prefix}up_proj.{pname}", up, 1
        return
    indices = getattr(module, "shard_indices", None)
    if indices is not None:  # vocab-parallel: the first num_org_elements rows are real, the rest padding
        yield f"{mod_name}.{pname}", data[: indices.num_org_elements], 1
        return
    sharded = hasattr(param, "output_dim") or hasattr(param, "input_dim")
    yield f"{mod_name}.{pname}", data, 1 if sharded else tp


def combine(out_dir: str, tp_size: int) -> dict[str, list[float]]:
    """Add up the TP ranks' files: `{hf_name: [sum, abs_sum, sum_of_squares]}` of the full tensors."""
    files = sorted(Path(out_dir).glob("rank-*.json"))
    if len(files) != tp_size:
        raise RuntimeError(f"weight probe: {len(files)} of {tp_size} engine TP ranks reported in {out_dir}")
    total: dict[str, list[float]] = {}
    for f in files:
        part = json.loads(f.read_text())
        if "__error__" in part:
            raise RuntimeError(f"weight probe failed in an engine scheduler: {part['__error__']}")
        for name, (*stats, replicas) in part.items():
            acc = total.setdefault(name, [0.0, 0.0, 0.0])
            for i, v in enumerate(stats):
                acc[i] += v / replicas
    return total


def mismatches(expected: dict[str, list[float]], served: dict[str, list[float]], rtol: float = 1e-6) -> list[str]:
    """Names (with both values) of tensors whose served statistics differ from the expected ones;
    a tensor missing on either side is a mismatch. Tolerance: `rtol` x the statistic's scale."""
    bad = []
    for name in sorted(set(expected) | set(served)):
        if name not in served or name not in expected:
            bad.append(f"{name} ({'not served by the engine' if name not in served else 'not sent'})")
            continue
        e, s = expected[name], served[name]
        scales = (max(e[1], s[1]), max(e[1], s[1]), max(e[2], s[2]))  # sum and abs-sum vs abs-sum; squares vs squares
        if any(abs(a - b) > rtol * max(sc, 1e-30) for a, b, sc in zip(e, s, scales)):
            bad.append(f"{name} (expected sum/abs/sq {e}, engine {s})")
    return bad
