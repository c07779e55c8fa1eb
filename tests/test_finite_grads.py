"""The finite-gradient check before each optimizer step (`megatron_workers.runner.MegatronRunner._check_finite_grads`).

Contract: the check reads the device once per optimizer step, whatever the parameter count (on a GPU each host read
is a device synchronize; one per parameter stalls the step once per tensor), and a non-finite gradient still refuses
the step with an error naming the mini-batch and the first parameter that holds it. On a CPU a host read is the
`aten._local_scalar_dense` op (`.item()`, `bool()`, `float()` on a tensor), which a dispatch mode counts.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_actor import make_rl_batch, masked_pg_loss, nan_loss

pytestmark = pytest.mark.unit


class HostReads(TorchDispatchMode):
    """Counts the ops that copy one tensor value to the host (a device synchronize on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def actor(world_of_one, tiny_model_dir):
    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig, OptimConfig

    return MegatronActor(tiny_model_dir, ActorConfig(optim=OptimConfig(lr=1e-3), ppo_micro_batch_size_per_gpu=4))


def test_one_host_read_per_optimizer_step(actor, monkeypatch):
    """Contract: two mini-batches, two optimizer steps: the finite check reads the device once in each, not once per
    parameter (the tiny model has many more parameters than that)."""
    original = type(actor)._check_finite_grads
    reads: list[int] = []

    def counted(self, mini_batch):
        with HostReads() as mode:
            original(self, mini_batch)
        reads.append(mode.count)

    monkeypatch.setattr(type(actor), "_check_finite_grads", counted)
    actor.update_policy(make_rl_batch(actor.hf_config.vocab_size, seed=3, B=8), masked_pg_loss, num_mini_batches=2)
    assert sum(1 for chunk in actor.model for _ in chunk.parameters()) > 2
    assert reads == [1, 1]


def test_non_finite_gradient_names_the_mini_batch_and_parameter(actor):
    """Contract: a NaN gradient refuses the step, naming the mini-batch and the first parameter holding it; the
    weights are unchanged."""
    before = {n: p.detach().clone() for chunk in actor.model for n, p in chunk.named_parameters()}
    with pytest.raises(FloatingPointError, match=r"non-finite gradient in mini-batch 0 \(first in \S*(decoder|embedding)"):
        actor.update_policy(make_rl_batch(actor.hf_config.vocab_size, seed=3, B=8), nan_loss)
    after = dict((n, p) for chunk in actor.model for n, p in chunk.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
