"""Host/device discipline of the Megatron ranks, checked on a CPU (`megatron_workers.device_check`).

Contract: a micro-batch goes to the device once and results come back to the host once; no op
anywhere in the actor's log-prob pass and update, the reference's log-prob pass, the critic's
value pass and update, or the SFT update mixes host and device tensors. On a GPU such an op is a
crash at step 1; on a CPU every tensor is a CPU tensor, so these tests tag each tensor by the side
of the seam it came from and refuse the op instead (one in-process rank, the tiny model).
"""
from __future__ import annotations

import pytest
import torch

from tests.test_actor import make_rl_batch, masked_pg_loss

pytestmark = pytest.mark.unit


def _cfg(optim: bool, dtype: str = "float32"):
    from megatron_workers.config import ActorConfig, MegatronConfig, OptimConfig

    return ActorConfig(optim=OptimConfig(lr=1e-3) if optim else None, ppo_micro_batch_size_per_gpu=3,
                       megatron=MegatronConfig(dtype=dtype))


def _checked(runner, batch):
    from megatron_workers.device_check import discipline

    return discipline(host=batch.values(), device=runner.device_tensors())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_actor_reference_logprobs_and_update_keep_the_seam(world_of_one, tiny_model_dir, dtype):
    """Contract: log-probs (actor and reference) and a PPO update run with every op on one side of the seam,
    through the seam's two crossings, and give host tensors back (fp32, and bf16 with the mixed-precision
    optimizer)."""
    from megatron_workers.actor import MegatronActor

    actor = MegatronActor(tiny_model_dir, _cfg(optim=True, dtype=dtype))
    batch = make_rl_batch(actor.hf_config.vocab_size, seed=1, B=6)
    with _checked(actor, batch) as d:
        out = actor.compute_log_prob(batch, calculate_entropy=True)
        metrics = actor.update_policy(batch, masked_pg_loss)
    assert d.crossings > 0
    assert out["log_probs"].device.type == "cpu" and d.side[out["log_probs"]] == "host"
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    ref = MegatronActor(tiny_model_dir, _cfg(optim=False, dtype=dtype))
    with _checked(ref, batch) as d:
        ref_out = ref.compute_log_prob(batch)
    assert d.side[ref_out["log_probs"]] == "host"


def test_critic_and_sft_keep_the_seam(world_of_one, tiny_model_dir, monkeypatch):
    """Contract: the critic's values and update and the SFT update keep the seam too; every inference and training
    phase ends by handing the allocator's cached memory back (torch.cuda.empty_cache)."""
    from megatron_workers.actor import MegatronActor
    from megatron_workers.critic import MegatronCritic

    critic = MegatronCritic(tiny_model_dir, _cfg(optim=True))
    batch = make_rl_batch(critic.hf_config.vocab_size, seed=1, B=6)
    batch["returns"] = torch.randn(batch["responses"].shape)

    def value_loss(mb):
        loss = (((mb["values"] - mb["returns"]) ** 2) * mb["response_mask"]).sum() / mb["global_token_count"]
        return loss, {"vf_loss": loss.detach()}

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    with _checked(critic, batch):
        values = critic.compute_values(batch)
        assert len(emptied) == 1
        critic.update_critic(batch, value_loss)
        assert len(emptied) == 2
    assert values["values"].device.type == "cpu"
    actor = MegatronActor(tiny_model_dir, _cfg(optim=True))
    with _checked(actor, batch):
        metrics = actor.update_sft(batch)
    assert metrics["sft/sft_loss"] > 0


def test_every_parameter_is_built_on_the_ranks_device_in_its_dtype(world_of_one, tmp_path, monkeypatch):
    """Contract: every parameter of the reference policy and the critic (bare models: no DDP buffer moves them),
    norms and Qwen3's q/k norms and the heads included, is built on the rank's device (`torch.cuda.current_device()`)
    in the parameters' dtype. Here that device answers `meta`, where no host tensor is, so a parameter built in
    host memory shows (on a GPU it crashes the first forward)."""
    from megatron_workers.actor import MegatronActor
    from megatron_workers.critic import MegatronCritic
    from recipe.tiny_model import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path / "qwen3", seed=0, arch="qwen3")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
    for role in (MegatronActor, MegatronCritic):
        runner = role(model_dir, _cfg(optim=False, dtype="bfloat16"))
        params = {n: p for m in runner.modules for n, p in m.named_parameters()}
        assert any("q_layernorm" in n for n in params) and any("output_layer" in n for n in params)
        elsewhere = {n: (p.device.type, p.dtype) for n, p in params.items()
                     if p.device.type != "meta" or p.dtype != torch.bfloat16}
        assert not elsewhere, f"{role.__name__}: parameters off the device or dtype: {elsewhere}"


def test_the_checker_refuses_a_mixed_op_and_a_stray_copy():
    """Contract: the checker itself refuses what a GPU would refuse (and not a 0-dim host scalar)."""
    from megatron_workers.device_check import DeviceMixError, discipline, to_device, to_host

    host = torch.ones(3)
    with discipline(host=[host]) as d:
        dev = to_device({"x": host}, torch.device("cpu"))["x"]
        assert d.side[dev] == "device"
        (dev * torch.tensor(2.0)).sum()  # a 0-dim host tensor is a scalar operand on a GPU too
        with pytest.raises(DeviceMixError, match="mixes host and device"):
            dev + host
        with pytest.raises(DeviceMixError):
            host.copy_(dev)  # a crossing outside the seam
        back = to_host(dev * 2)
        assert d.side[back] == "host"
        host + back
