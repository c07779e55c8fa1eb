"""Model FLOPs and the MFU estimate `perf/mfu/actor`: the share of the GPUs' peak the actor update achieved.

Training FLOPs of one sequence of s tokens (backward = 2 x forward; a multiply-add is 2 FLOPs):

    6 * N * s  +  12 * L * (heads * head_dim) * s^2

- N: the matmul weights every token goes through: per layer the q, k, v, o projections and the gated MLP
  (gate, up, down), plus the LM head (vocab x hidden). Biases and norms are left out (negligible), and so is the
  input embedding: it is a lookup, not a matmul. (verl counts the embedding as a second vocab x hidden matmul, so
  its figure reads a little higher for small models with large vocabularies.)
- The s^2 term is attention itself: QK^T and the weighted sum of V, each 2 * s * s * heads * head_dim FLOPs per
  layer forward, counted over the full s x s square as verl does (a causal kernel skips about half of it).

Only real tokens count (padding is not useful work). The peak is a device's dense (no sparsity) BF16 tensor-core
TFLOPS from the vendors' datasheets, looked up by the accelerator type Ray reports for the cluster's GPUs
(`PEAK_TFLOPS`), or `trainer.peak_tflops_per_gpu` for any other device. With neither (a CPU run, an unlisted
GPU) no MFU is logged rather than a made-up one. The actor trains in bf16 by default (`megatron.dtype`); with
float32 the BF16 peak is still the reference, as in verl's figure.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Dense BF16 tensor-core peak TFLOPS per device (datasheets, no sparsity), keyed by Ray's accelerator_type names.
PEAK_TFLOPS: dict[str, float] = {
    "A100": 312.0, "A100-40G": 312.0, "A100-80G": 312.0, "A800": 312.0,
    "H100": 989.0,  # SXM; an H100 PCIe peaks at 756: set trainer.peak_tflops_per_gpu=756
    "H800": 989.0, "H200": 989.0, "H20": 148.0,
    "B200": 2250.0, "GB200": 2500.0,
    "L40S": 362.0, "L4": 121.0,
    "AMD-Instinct-MI300X-OAM": 1307.0,
}


@dataclass(frozen=True)
class ModelFlops:
    """A dense decoder's FLOP coefficients, read from its HF config."""

    matmul_params: int  # N: weights every token multiplies through (layers' projections + LM head)
    attention_width: int  # L * heads * head_dim: the s^2 term's coefficient / 12

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelFlops:
        """From a transformers config or its dict (hidden_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim, intermediate_size, vocab_size)."""
        c = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        hidden, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or hidden // heads
        attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o: heads; k and v: kv heads
        mlp = 3 * hidden * c["intermediate_size"]  # gate, up, down
        return cls(matmul_params=layers * (attn + mlp) + c["vocab_size"] * hidden,
                   attention_width=layers * heads * head_dim)

    def training(self, seq_lens: Sequence[int]) -> float:
        """FLOPs of one forward + backward over sequences of these lengths (real tokens only)."""
        return float(6 * self.matmul_params * sum(seq_lens) + 12 * self.attention_width * sum(s * s for s in seq_lens))


def peak_tflops(configured: float | None, accelerator: str | None) -> float | None:
    """A device's peak TFLOPS: `trainer.peak_tflops_per_gpu` when set, else the table's entry for `accelerator`
    (None when it is unknown: no MFU is logged)."""
    if configured is not None:
        return configured
    peak = PEAK_TFLOPS.get(accelerator) if accelerator else None
    if accelerator and peak is None:
        logger.warning("no peak TFLOPS known for accelerator %r: perf/mfu/actor is not logged; set "
                       "trainer.peak_tflops_per_gpu=<dense BF16 TFLOPS of one device>", accelerator)
    return peak


def ray_accelerator_type() -> str | None:
    """The one GPU type Ray reports for the cluster (`accelerator_type:<name>` resources); None with none or
    several types, or without a Ray connection."""
    import ray

    if not ray.is_initialized():
        return None
    kinds = {k.split(":", 1)[1] for k in ray.cluster_resources() if k.startswith("accelerator_type:")}
    return kinds.pop() if len(kinds) == 1 else None


@dataclass(frozen=True)
class MFU:
    """MFU of the actor update on `devices` devices of `peak_tflops` each."""

    model: ModelFlops
    peak_tflops: float
    devices: int

    @classmethod
    def for_run(cls, hf_config: Any, configured_peak: float | None, devices: int) -> MFU | None:
        """The run's estimator, or None when no peak is known (see `peak_tflops`)."""
        peak = peak_tflops(configured_peak, ray_accelerator_type())
        return None if peak is None else cls(ModelFlops.from_hf_config(hf_config), peak, devices)

    def of_update(self, seq_lens: Sequence[int], epochs: int, seconds: float) -> float:
        """Achieved / peak FLOPs of `epochs` passes over sequences of `seq_lens` real tokens taking `seconds`."""
        return epochs * self.model.training(seq_lens) / (seconds * self.devices * self.peak_tflops * 1e12)
