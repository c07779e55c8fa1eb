"""Megatron actor on Ray vs transformers: log-probs, PPO updates across layouts, bad input.

All integration tests here share one Ray cluster (module fixture) and the tiny Qwen2
checkpoint; every layout is a fresh `MegatronWorkerGroup` of gloo CPU ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import local_ray_cluster

# ---------------------------------------------------------------------------------------------
# Helpers shared with test_checkpoint.py / test_worker_group.py (imported from here)
# ---------------------------------------------------------------------------------------------


def make_batch(vocab: int, seed: int = 0, B: int = 8, S: int = 24, T: int = 12) -> dict[str, torch.Tensor]:
    """A padded batch of variable-length multi-turn samples in verl's layout.

    Prompts are left-padded, responses right-padded; each response has a non-sampled span in
    the middle (a tool / user turn: attended to, `response_mask` 0). Token ids are random.
    """
    g = torch.Generator().manual_seed(seed)
    P = S - T
    input_ids = torch.randint(0, vocab, (B, S), generator=g)
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        p = int(torch.randint(2, P + 1, (1,), generator=g))  # prompt length
        r = int(torch.randint(3, T + 1, (1,), generator=g))  # response length (incl. tool span)
        attention_mask[b, P - p: P + r] = 1
        response_mask[b, :r] = 1
        if r >= 6:  # a tool turn in the middle of the response
            response_mask[b, 2: r - 2] = 0
    input_ids = input_ids * attention_mask  # pad id 0 where not attended
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, P:].clone(),
        "response_mask": response_mask,
    }



def make_rl_batch(vocab: int, seed: int, B: int) -> dict[str, torch.Tensor]:
    """`make_batch` with random old log-probs and advantages (B, T), drawn from seed + 1: a policy update's input."""
    batch = make_batch(vocab, seed=seed, B=B)
    g = torch.Generator().manual_seed(seed + 1)
    batch["old_log_probs"] = -torch.rand(batch["responses"].shape, generator=g)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g)
    return batch

def hf_log_probs(model_dir: Path, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own log-probs and entropy of the response tokens, (B, T) each, masked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    T = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits  # (B, S, V)
    logits = logits[:, -T - 1: -1].float()  # (B, T, V) predicting the response tokens
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = batch["response_mask"].float()
    return logp * mask, entropy * mask


def masked_pg_loss(mb: dict) -> tuple[torch.Tensor, dict]:
    """Token-mean clipped surrogate (a stand-in for recipe.algos' policy loss, same contract)."""
    mask = mb["response_mask"].float()
    ratio = torch.exp(mb["log_probs"] - mb["old_log_probs"])
    adv = mb["advantages"]
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    total = (loss * mask).sum() / mb["global_token_count"]
    return total, {"pg_loss": total.detach()}


@pytest.mark.unit
def test_validate_batch_refusals_name_the_sample():
    """Contract: shape disagreement, an empty response, NaN advantages/rewards and responses that are
    not the sequence's tail are refused with an error naming the key or sample index."""
    from megatron_workers.micro_batches import validate_batch

    base = make_batch(vocab=50, seed=1)
    validate_batch(base)
    bad = dict(base, response_mask=base["response_mask"][:, :-1])
    with pytest.raises(ValueError, match="response_mask"):
        validate_batch(bad)
    bad = dict(base, response_mask=base["response_mask"].clone())
    bad["response_mask"][3] = 0
    with pytest.raises(ValueError, match="sample 3: empty response"):
        validate_batch(bad)
    for key in ("advantages", "token_level_rewards"):
        vals = torch.zeros(base["responses"].shape)
        vals[5, 1] = float("nan")
        with pytest.raises(ValueError, match=f"sample 5: batch\\['{key}'\\] holds NaN"):
            validate_batch(dict(base, **{key: vals}))
    bad = dict(base, responses=base["responses"].clone())
    col = int(base["response_mask"][6].nonzero()[0])
    bad["responses"][6, col] += 1
    with pytest.raises(ValueError, match="sample 6: responses differ"):
        validate_batch(bad)


@pytest.mark.unit
def test_dynamic_micro_batches_respect_token_budget_and_cover_every_row():
    """Contract: dynamic micro-batches hold every row once and stay within ppo_max_token_len_per_gpu
    real tokens, and each micro-batch's pack holds exactly its rows' real tokens, in order."""
    from megatron_workers.config import ActorConfig
    from megatron_workers.micro_batches import split_micro_batches

    batch = make_batch(vocab=50, seed=2, B=16)
    cfg = ActorConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=60, optim=None)
    mbs = split_micro_batches(batch, cfg)
    rows = torch.cat([mb.rows for mb in mbs]).sort().values
    assert rows.tolist() == list(range(16))
    for mb in mbs:
        assert mb.tokens <= 60 or len(mb.rows) == 1
        real = mb.tensors["attention_mask"].bool()
        assert mb.pack.ids[0].tolist() == mb.tensors["input_ids"][real].tolist()
    assert len(mbs) > 1


@pytest.mark.unit
def test_virtual_pipeline_micro_batch_counts_are_multiples_of_pp_within_both_limits():
    """Contract: with interleaved_pp (PP under virtual pipeline stages) the micro-batch count becomes a multiple of it
    when the rows allow, every row still once, within the token budget and the fixed size, and every pack has the
    longest's length; with too few rows the count stays (the runner then runs them as one group)."""
    from megatron_workers.config import ActorConfig
    from megatron_workers.micro_batches import split_micro_batches

    batch = make_batch(vocab=50, seed=2, B=16)
    for cfg in (ActorConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=60, optim=None),
                ActorConfig(use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=3, optim=None)):
        plain = split_micro_batches(batch, cfg)
        for multiple in (2, 4):
            mbs = split_micro_batches(batch, cfg, interleaved_pp=multiple)
            assert len(mbs) % multiple == 0 and len(mbs) >= len(plain)
            assert len({mb.tokens for mb in mbs}) == 1
            assert mbs[0].tokens == max(int(mb.tensors["attention_mask"].sum()) for mb in mbs)
            assert torch.cat([mb.rows for mb in mbs]).sort().values.tolist() == list(range(16))
            for mb in mbs:
                assert 0 < len(mb.rows) <= (16 if cfg.use_dynamic_bsz else 3)
                assert mb.tokens <= 60 or len(mb.rows) == 1 or not cfg.use_dynamic_bsz
    assert len(split_micro_batches({k: v[:3] for k, v in batch.items()}, cfg, interleaved_pp=4)) == 1


# ---------------------------------------------------------------------------------------------
# Integration: Ray worker groups of real Megatron ranks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory, num_cpus=4, pickle_by_value=__name__):
        yield


@pytest.fixture(scope="module")
def groups(ray_cluster):
    """Worker groups by (tp, pp, dp, vpp), started once per module; tests rebuild the role on them."""
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout

    started: dict[tuple[int, int, int, int], MegatronWorkerGroup] = {}

    def get(tp: int, pp: int, dp: int = 1, vpp: int = 1) -> MegatronWorkerGroup:
        if (tp, pp, dp, vpp) not in started:
            started[(tp, pp, dp, vpp)] = MegatronWorkerGroup(ParallelLayout(tp=tp, pp=pp, dp=dp, vpp=vpp), seed=1)
        return started[(tp, pp, dp, vpp)]

    yield get
    for g in started.values():
        g.shutdown()


def build_actor(group, model_dir: Path, role_cls=None, **cfg_kwargs) -> None:
    """(Re)build a MegatronActor (or `role_cls`) from `model_dir` on every rank of `group` (fp32 unless
    `megatron=` says otherwise; fixed micro-batch sizes unless `use_dynamic_bsz=True`)."""
    import functools

    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig, MegatronConfig, OptimConfig

    optim = cfg_kwargs.pop("optim", OptimConfig(lr=1e-3, adam_eps=1e-4, clip_grad=1.0))
    cfg_kwargs.setdefault("megatron", MegatronConfig(dtype="float32"))  # parity with transformers in fp32
    cfg_kwargs.setdefault("use_dynamic_bsz", False)  # the tests' micro-batch sizes, unless they ask for token budgets
    cfg = ActorConfig(optim=optim, **cfg_kwargs)
    group.build(functools.partial(role_cls or MegatronActor, str(model_dir), cfg))


def update(group, batch: dict, mini_batch_size: int, loss_fn=masked_pg_loss) -> dict:
    """One update_policy call through the group; returns the (DP-summed) metrics."""
    n_mini = batch["input_ids"].shape[0] // mini_batch_size
    return group.dispatch("update_policy", batch, mini_batches=n_mini, loss_fn=loss_fn)[0]


def hf_weights(group) -> dict[str, torch.Tensor]:
    return group.call_all("hf_state_dict")[0]


def _vocab(model_dir: Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def ppo_batch(model_dir: Path, seed: int = 4) -> dict[str, torch.Tensor]:
    batch = make_batch(_vocab(model_dir), seed=seed)
    old_lp, _ = hf_log_probs(model_dir, batch)
    g = torch.Generator().manual_seed(seed)
    batch["old_log_probs"] = old_lp - 0.05 * torch.rand(old_lp.shape, generator=g)  # some ratios get clipped
    batch["advantages"] = torch.randn(old_lp.shape, generator=g) * batch["response_mask"]
    return batch


@pytest.mark.integration
def test_log_probs_tp2_pp2_match_transformers(groups, tiny_model_dir):
    """Contract: actor log-probs and entropy at (TP, PP) = (2, 2) equal transformers' on a padded
    multi-turn batch within 1e-4 (fp32), with fixed and with dynamic micro-batches."""
    from megatron_workers.worker_group import concat_results

    batch = make_batch(_vocab(tiny_model_dir), seed=3)
    ref_lp, ref_ent = hf_log_probs(tiny_model_dir, batch)
    group = groups(2, 2)
    for kwargs in ({"ppo_micro_batch_size_per_gpu": 3}, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 40}):
        build_actor(group, tiny_model_dir, optim=None, **kwargs)
        out = concat_results(group.dispatch("compute_log_prob", batch, calculate_entropy=True))
        torch.testing.assert_close(out["log_probs"], ref_lp, rtol=0, atol=1e-4)
        torch.testing.assert_close(out["entropy"], ref_ent, rtol=0, atol=1e-4)


@pytest.mark.integration
def test_ppo_update_same_weights_for_every_layout(groups, tiny_model_dir):
    """Contract: parallelism does not change the math. Two PPO mini-batch steps (Adam, grad
    clipping) from the same weights and batch give the same new weights within 1e-5 at
    (TP, PP) = (1,1), (2,1), (1,2), (2,2), and DP=2 equals DP=1 for the same global batch (with one and with two
    micro-batches per rank: the overlapped DP reduction waits for the last)."""
    batch = ppo_batch(tiny_model_dir)
    results = {}
    for layout in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (1, 1, 2, 1)]:
        group = groups(*layout[:3])
        # the last layout: DP=2 with two micro-batches per rank (the DP reduction overlaps the second's backward)
        build_actor(group, tiny_model_dir, ppo_micro_batch_size_per_gpu=layout[3] if len(layout) > 3 else 2)
        before = hf_weights(group)
        metrics = update(group, batch, mini_batch_size=4)
        results[layout] = (metrics, hf_weights(group))
    base_metrics, base = results[(1, 1, 1)]
    moved = max((base[k] - before[k]).abs().max().item() for k in base)
    assert moved > 1e-4, "the update did not change the weights"
    assert base_metrics["actor/grad_norm"] > 0 and base_metrics["actor/lr"] == pytest.approx(1e-3)
    for layout, (metrics, weights) in results.items():
        assert weights.keys() == base.keys()
        worst = max((weights[k] - base[k]).abs().max().item() for k in base)
        assert worst < 1e-5, f"layout {layout}: weights differ from (1,1,1) by {worst:.2e}"
        assert metrics["actor/pg_loss"] == pytest.approx(base_metrics["actor/pg_loss"], abs=1e-5)
        assert metrics["actor/grad_norm"] == pytest.approx(base_metrics["actor/grad_norm"], rel=1e-4)


def nan_loss(mb: dict) -> tuple[torch.Tensor, dict]:
    """A loss whose gradient is NaN (sqrt at 0 of a masked-out quantity)."""
    x = (mb["log_probs"] * 0.0).sum()
    return torch.sqrt(x - x) * 0 + torch.sqrt(-torch.ones(()) + mb["log_probs"].sum() * 0), {}


@pytest.mark.integration
def test_bad_input_refused_and_weights_never_nan(groups, tiny_model_dir):
    """Contract: NaN advantages, an empty response or mismatched shapes are refused naming the
    sample; a loss that yields a NaN gradient refuses the optimizer step and leaves the
    weights untouched (no silent NaN in the weights)."""
    import ray

    group = groups(1, 1)
    build_actor(group, tiny_model_dir, ppo_micro_batch_size_per_gpu=4)
    before = hf_weights(group)
    batch = ppo_batch(tiny_model_dir)
    bad = dict(batch, advantages=batch["advantages"].clone())
    bad["advantages"][2, 0] = float("nan")
    with pytest.raises(ray.exceptions.RayTaskError, match="sample 2: batch\\['advantages'\\] holds NaN"):
        update(group, bad, mini_batch_size=8)
    bad = dict(batch, response_mask=batch["response_mask"].clone())
    bad["response_mask"][7] = 0
    with pytest.raises(ray.exceptions.RayTaskError, match="sample 7: empty response"):
        update(group, bad, mini_batch_size=8)
    with pytest.raises(ray.exceptions.RayTaskError, match="non-finite gradient in mini-batch 0"):
        update(group, batch, mini_batch_size=8, loss_fn=nan_loss)
    after = hf_weights(group)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed after refused updates"


def hf_values(model_dir: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Critic values computed with transformers' backbone and the critic's seeded head, (B, T)."""
    from transformers import AutoModelForCausalLM

    from megatron_workers.critic import MegatronCritic, ValueHead
    from megatron_workers.model import hf_to_transformer_config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    std = hf_to_transformer_config(model.config).init_method_std
    head = ValueHead(model.config.hidden_size, std, MegatronCritic.head_seed, sequence_parallel=False)
    T = batch["responses"].shape[1]
    with torch.no_grad():
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).last_hidden_state  # (B, S, H), after the final norm
        values = head(hidden)[0].squeeze(-1)[:, -T - 1: -1]  # (B, T)
    return values * batch["response_mask"].float()


@pytest.mark.integration
def test_critic_values_match_transformers_and_update_is_layout_independent(groups, tiny_model_dir):
    """Contract: the critic's values at (TP, PP) = (2, 2) equal transformers' backbone + the same
    value head within 1e-4, and one clipped-value-loss update (recipe.algos.value_loss) gives the
    same new values at (1,1) and (2,2)."""
    import functools

    from megatron_workers.critic import MegatronCritic
    from megatron_workers.worker_group import concat_results
    from recipe.algos import ValueLossConfig, value_loss

    batch = make_batch(_vocab(tiny_model_dir), seed=9)
    ref = hf_values(tiny_model_dir, batch)
    g = torch.Generator().manual_seed(9)
    train = dict(batch, old_values=ref, returns=ref + torch.randn(ref.shape, generator=g) * batch["response_mask"])
    loss_fn = functools.partial(value_loss, cfg=ValueLossConfig(cliprange_value=0.2))
    after = {}
    for layout in [(2, 2), (1, 1)]:
        group = groups(*layout)
        build_actor(group, tiny_model_dir, role_cls=MegatronCritic, ppo_micro_batch_size_per_gpu=3)
        values = concat_results(group.dispatch("compute_values", batch))["values"]
        torch.testing.assert_close(values, ref, rtol=0, atol=1e-4)
        metrics = group.dispatch("update_critic", train, mini_batches=2, loss_fn=loss_fn)[0]
        assert metrics["critic/vf_loss"] > 0 and metrics["critic/grad_norm"] > 0
        after[layout] = concat_results(group.dispatch("compute_values", batch))["values"]
    assert (after[(1, 1)] - ref).abs().max() > 1e-3, "the critic update did not move the values"
    torch.testing.assert_close(after[(2, 2)], after[(1, 1)], rtol=0, atol=1e-5)


def padded_torch_step(model_dir: Path, batch: dict[str, torch.Tensor], loss_fn, lr: float, eps: float,
                      critic: bool = False) -> dict:
    """One update in plain PyTorch on the padded batch: transformers' model (`critic`: its backbone and the critic's
    seeded value head) gives `(B, T)` log-probs (or values), `loss_fn` the loss, torch's Adam the step. Returns the
    loss, the outputs before and after the step, and the weights before and after it (HF names)."""
    from transformers import AutoModelForCausalLM

    from megatron_workers.critic import MegatronCritic, ValueHead
    from megatron_workers.model import hf_to_transformer_config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    head = ValueHead(model.config.hidden_size, hf_to_transformer_config(model.config).init_method_std,
                     MegatronCritic.head_seed, sequence_parallel=False)
    T, mask = batch["responses"].shape[1], batch["response_mask"].float()

    def outputs() -> torch.Tensor:  # (B, T), 0 off the response mask
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        if critic:
            hidden = model.model(**inputs).last_hidden_state  # (B, S, H), after the final norm
            return head(hidden)[0].squeeze(-1)[:, -T - 1: -1] * mask
        logits = model(**inputs).logits[:, -T - 1: -1].float()  # (B, T, V)
        return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) * mask

    weights_before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=lr, eps=eps)
    before = outputs()
    loss, _ = loss_fn({**batch, "values" if critic else "log_probs": before, "global_token_count": int(mask.sum()),
                       "global_seq_count": len(mask)})
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = outputs()
    return {"loss": loss.item(), "before": before.detach(), "after": after, "weights_before": weights_before,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def with_saved_tensor_probe(role_cls: type) -> type:
    """`role_cls` whose `update_policy` records, for each tensor autograd keeps for backward, whether it is
    vocabulary-sized (last dimension V/tp) and not a parameter."""

    class Probe(role_cls):
        def update_policy(self, *args, **kwargs):
            from megatron.core import parallel_state as mpu

            params = {p.data_ptr() for m in self.modules for p in m.parameters()}
            part = self.hf_config.vocab_size // mpu.get_tensor_model_parallel_world_size()
            self.saved = []  # (shape, vocabulary-sized and not a parameter)

            def pack(t: torch.Tensor) -> torch.Tensor:
                self.saved.append((tuple(t.shape), t.dim() > 0 and t.shape[-1] == part and t.data_ptr() not in params))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return super().update_policy(*args, **kwargs)

        def saved_for_backward(self) -> list[tuple[tuple[int, ...], bool]]:
            return self.saved

    return Probe


@pytest.mark.integration
def test_packed_equals_padded_for_actor_critic_and_sft(groups, tiny_model_dir):
    """Contract: at (TP, PP) = (2, 2), with three micro-batches, the packed Megatron passes equal plain PyTorch on the
    padded batch (transformers, eager attention under the mask) within 1e-5 (fp32): the actor's log-probs, PPO loss
    and new weights; SFT's loss and new weights; the critic's values, value loss and new values. Adam's first step
    with eps = lr = 100 is lr * g / (|g| + eps), close to a plain SGD step, so new weights within 1e-5 mean gradients
    within about 1e-5 (grad clipping off). The LM head is fused into the log-probs (`actor.HeadInput` +
    `logprobs.linear_logprobs_entropy`), so the PPO update keeps no `(tokens, V/tp)` logits for backward on any
    rank, only parameters and O(tokens x hidden) activations (the textbook head, ColumnParallelLinear then
    log-softmax, would keep them)."""
    import functools

    from megatron_workers.actor import MegatronActor, sft_loss
    from megatron_workers.config import OptimConfig
    from megatron_workers.critic import MegatronCritic
    from megatron_workers.worker_group import concat_results
    from recipe.algos import ValueLossConfig, value_loss

    optim = OptimConfig(lr=100.0, adam_eps=100.0, clip_grad=0.0)
    group = groups(2, 2)
    batch = ppo_batch(tiny_model_dir, seed=13)
    for method, loss_fn, metric, kwargs in (("update_policy", masked_pg_loss, "actor/pg_loss", {"loss_fn": masked_pg_loss}),
                                            ("update_sft", sft_loss, "sft/sft_loss", {})):
        ref = padded_torch_step(tiny_model_dir, batch, loss_fn, optim.lr, optim.adam_eps)
        build_actor(group, tiny_model_dir, role_cls=with_saved_tensor_probe(MegatronActor), optim=optim,
                    ppo_micro_batch_size_per_gpu=3)
        log_probs = concat_results(group.dispatch("compute_log_prob", batch))["log_probs"]
        torch.testing.assert_close(log_probs, ref["before"], rtol=0, atol=1e-5)
        metrics = group.dispatch(method, batch, mini_batches=1, **kwargs)[0]
        assert metrics[metric] == pytest.approx(ref["loss"], abs=1e-5)
        if method == "update_policy":
            for rank, saved in enumerate(group.call_all("saved_for_backward")):
                assert len(saved) > 50, f"rank {rank}: the probe saw only {len(saved)} saved tensors"
                vocab_sized = [shape for shape, big in saved if big]
                assert not vocab_sized, f"rank {rank} keeps vocabulary-sized tensors for backward: {vocab_sized}"
        moved = max((ref["weights"][k] - v).abs().max().item() for k, v in ref["weights_before"].items())
        assert moved > 1e-3, f"{method}: the reference step did not move the weights"
        for k, v in hf_weights(group).items():
            torch.testing.assert_close(v, ref["weights"][k], rtol=0, atol=1e-5, msg=f"{method}: {k}")

    g = torch.Generator().manual_seed(13)
    old = hf_values(tiny_model_dir, batch)
    train = dict(batch, old_values=old, returns=old + torch.randn(old.shape, generator=g) * batch["response_mask"])
    loss_fn = functools.partial(value_loss, cfg=ValueLossConfig(cliprange_value=0.2))
    ref = padded_torch_step(tiny_model_dir, train, loss_fn, optim.lr, optim.adam_eps, critic=True)
    build_actor(group, tiny_model_dir, role_cls=MegatronCritic, optim=optim, ppo_micro_batch_size_per_gpu=3)
    torch.testing.assert_close(concat_results(group.dispatch("compute_values", batch))["values"], ref["before"],
                               rtol=0, atol=1e-5)
    metrics = group.dispatch("update_critic", train, mini_batches=1, loss_fn=loss_fn)[0]
    assert metrics["critic/vf_loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert (ref["after"] - ref["before"]).abs().max() > 1e-3, "the reference step did not move the values"
    torch.testing.assert_close(concat_results(group.dispatch("compute_values", batch))["values"], ref["after"],
                               rtol=0, atol=1e-5)


def torch_sft_step(model_dir: Path, batch: dict[str, torch.Tensor], lr: float, eps: float, clip: float) -> dict:
    """The same SFT step in plain PyTorch: transformers model, masked token-mean CE, AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=0.0)
    T = batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits[:, -T - 1: -1]  # (B, T, V)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].float()
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return {"loss": loss.item(), "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.integration
def test_sft_update_matches_plain_pytorch_adamw(groups, tiny_model_dir):
    """Contract: update_sft at (TP, PP) = (1, 2) with 2 micro-batches is the same step as plain
    PyTorch (transformers model, masked token-mean cross-entropy, clip, AdamW): same loss and
    new weights within 1e-5."""
    from megatron_workers.config import OptimConfig

    batch = make_batch(_vocab(tiny_model_dir), seed=10)
    ref = torch_sft_step(tiny_model_dir, batch, lr=1e-3, eps=1e-4, clip=0.5)
    group = groups(1, 2)
    build_actor(group, tiny_model_dir, ppo_micro_batch_size_per_gpu=4, optim=OptimConfig(lr=1e-3, adam_eps=1e-4, clip_grad=0.5))
    metrics = group.dispatch("update_sft", batch)[0]
    weights = hf_weights(group)
    assert metrics["sft/sft_loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert metrics["sft/grad_norm"] > 0.5  # clipping was active
    for k, v in weights.items():
        assert (v - ref["weights"][k]).abs().max() < 1e-5, f"{k} differs from the PyTorch step"


def with_grad_probe(role_cls: type) -> type:
    """`role_cls` plus two probes: this rank's gradients after an update (Megatron's grad buffers, which only the
    next update zeroes) and the sequence-parallel and recompute fields its model was built with."""

    class Probe(role_cls):
        def grads(self) -> dict[str, torch.Tensor]:
            return {n: p.main_grad.detach().clone() for n, p in self.modules[0].named_parameters()}

        def memory_features(self) -> tuple:
            c = self.modules[0].config
            return c.sequence_parallel, c.recompute_granularity, c.recompute_method, c.recompute_num_layers

    return Probe


@pytest.mark.integration
def test_sequence_parallel_and_recompute_give_the_same_loss_and_gradients(groups, tiny_model_dir):
    """Contract: sequence parallelism (verl's default at TP > 1; our RMSNorm in the local spec, its weight gradient
    summed over TP) and Megatron's full activation recompute (what verl's enable_gradient_checkpointing and
    override_transformer_config.recompute_granularity=full both become: tests/test_verl_launch.py), alone and
    together, run on CPU + gloo at TP=2 and change nothing but memory: the actor's PPO loss and every gradient on
    every rank equal plain TP=2's within 1e-6 (fp32). Odd-length packs get padded to the TP multiple."""
    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import FULL_RECOMPUTE, MegatronConfig

    batch = ppo_batch(tiny_model_dir, seed=11)
    assert int(batch["attention_mask"][:3].sum()) % 2 == 1, "the test wants an odd number of tokens in a pack"
    group = groups(2, 1)
    runs = {}
    for sp, recompute in ((False, False), (True, False), (False, True), (True, True)):
        overrides = {"recompute_granularity": "full"} if recompute else {}
        build_actor(group, tiny_model_dir, role_cls=with_grad_probe(MegatronActor), ppo_micro_batch_size_per_gpu=3,
                    megatron=MegatronConfig(dtype="float32", sequence_parallel=sp, override_transformer_config=overrides))
        expected = (sp, *(FULL_RECOMPUTE.values() if recompute else (None,) * 3))
        assert group.call_all("memory_features") == [expected] * 2
        runs[sp, recompute] = update(group, batch, mini_batch_size=8), group.call_all("grads")
    plain, plain_grads = runs.pop((False, False))
    assert plain["actor/grad_norm"] > 0
    for (sp, recompute), (metrics, grads) in runs.items():
        assert metrics["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], abs=1e-6)
        for rank_plain, rank_other in zip(plain_grads, grads):
            assert rank_plain.keys() == rank_other.keys()
            for name, grad in rank_plain.items():
                torch.testing.assert_close(rank_other[name], grad, rtol=0, atol=1e-6,
                                           msg=f"sp={sp} recompute={recompute}: gradient {name}")


@pytest.mark.integration
def test_reference_in_its_own_layout_gives_the_actors_log_probs(groups, tiny_model_dir):
    """Contract: a reference in a layout unlike the actor's (actor TP=2 x DP=1; reference TP=1 x DP=2 on the same
    number of ranks, its config from RefSection.reference) gives the actor's log-probs before any update (same
    weights) within 1e-5 (fp32)."""
    import functools

    from megatron_workers.actor import MegatronActor
    from megatron_workers.config import ActorConfig, MegatronConfig
    from megatron_workers.worker_group import concat_results
    from recipe.config_schema import RefMegatronConfig, RefSection

    batch = make_batch(_vocab(tiny_model_dir), seed=12)
    actor_cfg = ActorConfig(optim=None, ppo_micro_batch_size_per_gpu=4,
                            megatron=MegatronConfig(dtype="float32", tensor_model_parallel_size=2))
    ref_cfg = RefSection(megatron=RefMegatronConfig(tensor_model_parallel_size=1)).reference(actor_cfg)
    log_probs = {}
    for name, group, cfg in (("actor", groups(2, 1), actor_cfg), ("ref", groups(1, 1, 2), ref_cfg)):
        group.build(functools.partial(MegatronActor, str(tiny_model_dir), cfg))
        log_probs[name] = concat_results(group.dispatch("compute_log_prob", batch))["log_probs"]
    assert ref_cfg.megatron.tensor_model_parallel_size == 1 and log_probs["actor"].abs().sum() > 0
    torch.testing.assert_close(log_probs["ref"], log_probs["actor"], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def four_layer_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 checkpoint with 4 layers and tied embeddings: PP=2 x 2 virtual stages gives one layer a chunk."""
    from recipe.tiny_model import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("four_layers"), layers=4, tie_word_embeddings=True, seed=1)


@pytest.mark.integration
def test_virtual_pipeline_stages_change_the_schedule_not_the_math(groups, four_layer_model_dir, tmp_path):
    """Contract: virtual pipeline stages (PP=2, 2 model chunks per rank: rank 0 holds layers 1 and 3, rank 1 layers 2
    and 4 and the tied output copy; Megatron's interleaved schedule) give transformers' log-probs within 1e-4 (fixed
    micro-batches and token budgets, their counts spread to multiples of PP) and the critic's values of PP=1; the
    stage exports the weight sync ships hold exactly PP=1's tensors; two PPO steps give PP=1's weights, loss and
    gradient norm within 1e-5; a checkpoint resumes bit-identically, and `recipe.export_hf` exports it bit-equal."""
    from safetensors.torch import load_file

    from megatron_workers.critic import MegatronCritic
    from megatron_workers.sync_plan import SyncPlan
    from megatron_workers.worker_group import concat_results
    from recipe import checkpoint, export_hf

    model_dir = four_layer_model_dir
    batch = make_batch(_vocab(model_dir), seed=3)
    ref_lp, _ = hf_log_probs(model_dir, batch)
    plain, virtual = groups(1, 1), groups(1, 2, 1, 2)
    for kwargs in ({"ppo_micro_batch_size_per_gpu": 3}, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 40}):
        build_actor(virtual, model_dir, optim=None, **kwargs)
        out = concat_results(virtual.dispatch("compute_log_prob", batch))
        torch.testing.assert_close(out["log_probs"], ref_lp, rtol=0, atol=1e-4)

    values = {}
    for name, group in (("plain", plain), ("virtual", virtual)):
        build_actor(group, model_dir, role_cls=MegatronCritic, ppo_micro_batch_size_per_gpu=3)
        values[name] = concat_results(group.dispatch("compute_values", batch))["values"]
    assert values["plain"].abs().sum() > 0
    torch.testing.assert_close(values["virtual"], values["plain"], rtol=0, atol=1e-5)

    plan = SyncPlan(transport="none", bucket_bytes=1 << 16, dtype="float32", key="vpp", checksums=True)
    train = ppo_batch(model_dir)
    results = {}
    for name, group in (("plain", plain), ("virtual", virtual)):
        build_actor(group, model_dir, ppo_micro_batch_size_per_gpu=3)
        sent = [out["stats"] for out in group.send_weights(plan) if out is not None]
        stats = {k: v for per_stage in sent for k, v in per_stage.items()}
        assert sum(len(per_stage) for per_stage in sent) == len(stats), "a tensor was exported by two stages"
        results[name] = stats, update(group, train, mini_batch_size=4), hf_weights(group)
    (plain_stats, plain_metrics, plain_weights), (stats, metrics, weights) = results["plain"], results["virtual"]
    assert stats == plain_stats
    assert plain_metrics["actor/grad_norm"] > 0
    assert metrics["actor/pg_loss"] == pytest.approx(plain_metrics["actor/pg_loss"], abs=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(plain_metrics["actor/grad_norm"], rel=1e-4)
    assert weights.keys() == plain_weights.keys()
    for k in weights:
        assert (weights[k] - plain_weights[k]).abs().max() < 1e-5, f"{k} differs from PP=1's"

    state = checkpoint.TrainerState(step=1, weight_version=1, kl_coef=0.0, batches_consumed=1, epoch=0)

    def write(directory: Path) -> None:  # what Trainer.save_checkpoint writes
        virtual.call_all("save_checkpoint", str(directory / "actor"))
        state.write(directory)

    checkpoint.save(tmp_path / "run", 1, write)
    cont_metrics, cont = update(virtual, ppo_batch(model_dir, seed=5), mini_batch_size=4), hf_weights(virtual)
    build_actor(virtual, model_dir, ppo_micro_batch_size_per_gpu=3)
    assert virtual.call_all("load_checkpoint", str(tmp_path / "run" / "global_step_1" / "actor")) == [2, 2]
    assert update(virtual, ppo_batch(model_dir, seed=5), mini_batch_size=4) == cont_metrics
    resumed = hf_weights(virtual)
    for k in cont:
        assert torch.equal(resumed[k], cont[k]), f"{k} differs after resume"

    summary = export_hf.export(tmp_path / "run", tmp_path / "hf", dtype="float32")  # the CLI's ranks, chunk by chunk
    assert (summary["pp"], summary["tensors"]) == (2, len(weights))
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    for k in weights:
        assert torch.equal(exported[k], weights[k]), f"{k} differs in the HF export of the checkpoint"
