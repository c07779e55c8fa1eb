"""Actor and reference policy on Megatron-Core: log-probs, entropy, PPO and SFT updates.

`MegatronActor` is a `runner.MegatronRunner` (the per-rank model shard, device seam, schedule and
optimizer) with the LM head's outputs: per-token log-probs and entropy of the response tokens,
vocab-parallel (`logprobs.py`: the full vocabulary never sits on one rank), in fp32. The
reference policy is the same class with `optim=None`: no optimizer, no gradient buffers.

The LM head's matmul is fused into the log-prob computation: the last stage's output layer hands back
its input (`HeadInput`), and `logprobs.linear_logprobs_entropy` projects only the response positions,
a chunk of tokens at a time, so no `(tokens, V/tp)` logits are ever kept for backward (what backward
keeps is O(tokens): the head's input rows and three fp32 numbers per token).

`update_policy(batch, loss_fn)` calls `loss_fn(mb) -> (loss, metrics)` once per micro-batch with
`mb["log_probs"] (b, T)` (with grad), `mb["entropy"]`, the batch's own tensors for those rows and
the ints `global_token_count` / `global_seq_count`; the summing contract is `runner.py`'s.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

from megatron_workers.config import ActorConfig
from megatron_workers.logprobs import linear_logprobs_entropy
from megatron_workers.micro_batches import Batch, MicroBatch, validate_batch
from megatron_workers.runner import LossFn, MegatronRunner
from megatron_workers.sync_plan import GroupAddress, SyncPlan


def sft_loss(mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Masked token-mean cross-entropy contribution of one micro-batch (used by update_sft)."""
    nll = -(mb["log_probs"] * mb["response_mask"]).sum() / mb["global_token_count"]
    return nll, {"sft_loss": nll.detach()}


class HeadInput(torch.nn.Module):
    """Takes the place of the LM head's `ColumnParallelLinear` on the last stage and returns its input,
    `hidden (s or s/tp, b, h) -> (s, b, h)`, with the column-parallel layer's communication: gathered over
    the sequence under sequence parallelism (backward: reduce-scatter), else an identity whose backward
    sums the TP ranks' shares. The vocabulary projection is left to `linear_logprobs_entropy`.

    It holds the layer's weight Parameter under the same name (`output_layer.weight`; None when the
    embedding's is used), so checkpoints, the weight sync and Megatron's tied-embedding gradient sum
    see the same parameter.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.weight = layer.weight
        self.sequence_parallel, self.tp_group = layer.sequence_parallel, layer.tp_group

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=self.tp_group), None
        return copy_to_tensor_model_parallel_region(hidden, group=self.tp_group), None


class MegatronActor(MegatronRunner):
    """Policy (or, with `cfg.optim=None`, reference) worker for one rank.

    `temperature` is the rollout's sampling temperature: logits are divided by it before the
    softmax, so log-probs match what the engine sampled from.
    """

    def __init__(self, hf_dir: str | Path, cfg: ActorConfig, temperature: float = 1.0,
                 trust_remote_code: bool = False) -> None:
        self.temperature = temperature
        super().__init__(hf_dir, cfg, trust_remote_code)

    def _build_model(self, hf_state: dict[str, torch.Tensor], vp_stage: int | None) -> torch.nn.Module:
        module = super()._build_model(hf_state, vp_stage)
        if module.post_process:
            module.output_layer = HeadInput(module.output_layer)
        return module

    def _head(self, mb: MicroBatch, dev: Batch, output: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, targets, real = self._response_outputs(dev, output)  # (n, h), (n,), (b, T)
        last = self.modules[-1]  # the chunk with the LM head
        weight = (last.shared_embedding_or_output_weight() if last.share_embeddings_and_output_weights
                  else last.output_layer.weight)  # (V/tp, h)
        log_probs, entropy = linear_logprobs_entropy(
            hidden, weight, targets, mpu.get_tensor_model_parallel_group(), temperature=self.temperature
        )  # (n,) each
        return {"log_probs": self.on_response_axis(log_probs, real), "entropy": self.on_response_axis(entropy, real)}

    def compute_log_prob(self, batch: Batch, calculate_entropy: bool = False) -> Batch:
        """Per-token log-probs `(B, T)` of the response tokens (0 on padding), and entropy.

        Returns `{"log_probs": (B, T)}` plus `"entropy": (B, T)` when asked; complete on the last
        pipeline stage (other stages return an empty dict).
        """
        keys = ("log_probs", "entropy") if calculate_entropy else ("log_probs",)
        return self._infer(batch, keys)

    def update_policy(self, batch: Batch, loss_fn: LossFn, num_mini_batches: int = 1) -> dict[str, float]:
        """PPO-style update: `ppo_epochs` passes of one optimizer step per mini-batch.

        `loss_fn` is the trainer's policy loss (see the module docstring for its contract);
        `num_mini_batches` = global batch / ppo_mini_batch_size (the group's `dispatch(...,
        mini_batches=n)` splits the batch to match and passes it here). Returns `actor/*`
        metrics averaged over optimizer steps (loss_fn's metrics summed over micro-batches
        and DP ranks first), plus `actor/grad_norm` and `actor/lr`.
        """
        validate_batch(batch)
        return self._train(batch, loss_fn, num_mini_batches, self.cfg.ppo_epochs, "actor")

    def update_sft(self, batch: Batch, num_mini_batches: int = 1) -> dict[str, float]:
        """One pass of masked cross-entropy on the response tokens (`response_mask` = 1)."""
        validate_batch(batch)
        return self._train(batch, sft_loss, num_mini_batches, 1, "sft")

    # -- weight sync (driven by recipe.weight_sync through the worker group; plain data: sync_plan) ----------------

    def weight_sync_endpoint(self) -> Optional[GroupAddress]:
        """Distributed path: where this stage's sender hosts its group (None on non-senders)."""
        return self._weight_sender.endpoint()

    def init_weight_sync_groups(self, groups: dict[int, GroupAddress]) -> None:
        """Distributed path: each stage's sender hosts the group the engines join (`WeightSender.init_groups`)."""
        self._weight_sender.init_groups(groups)

    def destroy_weight_sync_groups(self) -> None:
        self._weight_sender.destroy_groups()

    def send_weights(self, plan: SyncPlan) -> Optional[dict[str, Any]]:
        """Stream this stage's weights to the engines (`WeightSender.send`); collective over the TP group. Offloaded
        parameters come back to the device for it (the trainer syncs after the offload that follows training)."""
        with self.params_on_device():
            return self._weight_sender.send(self.modules, self.hf_config, plan)

    @functools.cached_property
    def _weight_sender(self) -> "WeightSender":
        from megatron_workers.weights import WeightSender

        return WeightSender()

    # -- end of weight sync ------------------------------------------------------------------------
