"""Value model for PPO / GAE: the policy's Megatron backbone with a scalar head.

`MegatronCritic` builds the same GPTModel stage as the actor from an HF checkpoint (so the
backbone starts from the policy's weights), then replaces the last stage's vocabulary
projection with a `hidden -> 1` linear `ValueHead`. The value of response token `j` is read
at the position that *predicts* it (`S-T-1+j`): the value of the state before the token is
sampled, as in verl's critic.

Where it departs from verl's Megatron critic: the head is a plain linear layer replicated on
every TP rank rather than a column-parallel layer with output size 1 (which cannot be split);
its input (after the final norm) is complete on every TP rank (gathered first under sequence
parallelism, each rank's backward keeping its own slice), so its gradient is identical on all
of them and needs no reduction. It is initialised from a seeded generator
(normal, std = the model's `init_method_std`) so every rank and replica starts equal. With
tied embeddings the head is untied from the word embedding (the critic has no LM head).

Training reuses the actor's engine (`actor.MegatronRunner`): the trainer's clipped value loss
comes in as `loss_fn(mb) -> (loss, metrics)` with `mb["values"] (b, T)` carrying gradients,
the same summing contract as the policy loss.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_workers.micro_batches import Batch, MicroBatch, validate_batch
from megatron_workers.runner import LossFn, MegatronRunner

logger = logging.getLogger(__name__)

_NO_HF_FORM = (
    "a critic has a value head, not an LM head, so it has no HF causal-LM form; "
    "use save_checkpoint / load_checkpoint to persist it"
)


class ValueHead(torch.nn.Module):
    """`hidden (s, b, h) -> values (s, b, 1)`, called like Megatron's output layer."""

    def __init__(self, hidden_size: int, init_std: float, seed: int, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel  # the input is this TP rank's slice of the sequence
        self.linear = torch.nn.Linear(hidden_size, 1)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(self.linear.weight.shape, generator=g) * init_std)
            self.linear.bias.zero_()

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        if self.sequence_parallel:  # (s/tp, b, h) -> (s, b, h); backward: this rank's slice, not a sum over ranks
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return self.linear(hidden), None


class MegatronCritic(MegatronRunner):
    """Critic worker for one rank: `compute_values`, `update_critic`, checkpointing."""

    head_seed = 1234  # the value head's init seed (same on every rank)

    def _build_model(self, hf_state: dict[str, torch.Tensor], vp_stage: int | None) -> torch.nn.Module:
        module = super()._build_model(hf_state, vp_stage)
        module.share_embeddings_and_output_weights = False
        if module.post_process:
            device = next(module.parameters()).device
            module.output_layer = ValueHead(
                module.config.hidden_size, module.config.init_method_std, self.head_seed, module.config.sequence_parallel
            ).to(device=device, dtype=module.config.params_dtype)
        return module

    def _head(self, mb: MicroBatch, dev: Batch, output: torch.Tensor) -> dict[str, torch.Tensor]:
        values, _, real = self._response_outputs(dev, output)  # (n, 1), (b, T)
        return {"values": self.on_response_axis(values.squeeze(-1).float(), real)}

    def compute_values(self, batch: Batch) -> Batch:
        """Per-token values `(B, T)` of the response positions (0 on padding); last stage only."""
        return self._infer(batch, ("values",))

    def update_critic(self, batch: Batch, loss_fn: LossFn, num_mini_batches: int = 1) -> dict[str, float]:
        """`ppo_epochs` passes of one optimizer step per mini-batch on the trainer's value loss
        (`loss_fn` contract and `num_mini_batches` as in `MegatronActor.update_policy`)."""
        validate_batch(batch)
        return self._train(batch, loss_fn, num_mini_batches, self.cfg.ppo_epochs, "critic")

    def hf_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        raise NotImplementedError(_NO_HF_FORM)

    def export_hf(self, path: str) -> None:
        raise NotImplementedError(_NO_HF_FORM)
