"""Chunked vocab-parallel log-prob / entropy fused with the LM head's matmul (`megatron_workers.logprobs`):
values and gradients equal plain full-vocabulary autograd (log_softmax + gather, -(p log p).sum()) in fp32
within 1e-6 (gradients: 1e-6 plus 1e-6 relative) at TP=1 and over 2 gloo ranks, for any chunk size; a bf16
head gets an fp32 log-softmax; and what is kept for backward is O(tokens), not O(tokens x vocabulary)."""
from __future__ import annotations

import pytest
import torch

from megatron_workers.logprobs import linear_logprobs_entropy
from megatron_workers.ports import free_port

B, T, H, V = 3, 7, 16, 40  # 21 tokens: chunk sizes 1, 5 and 1024 leave ragged or single chunks
TOL = {"rtol": 0, "atol": 1e-6}  # values
GRAD_TOL = {"rtol": 1e-6, "atol": 1e-6}  # gradients reach ~2 here: 1e-6 relative is their fp32 rounding


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(B, T, H, generator=g) * 0.5,  # (B, T, H)
        "weight": torch.randn(V, H, generator=g) * 0.5,  # (V, H)
        "target": torch.randint(0, V, (B, T), generator=g),  # (B, T)
        "w_lp": torch.randn(B, T, generator=g),  # upstream gradients
        "w_ent": torch.randn(B, T, generator=g),
    }


def _reference(logits: torch.Tensor, target: torch.Tensor, temperature: float):
    """Today's textbook math on the full vocabulary, by autograd."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _loss(lp, ent, x):
    return (lp * x["w_lp"]).sum() + (ent * x["w_ent"]).sum()


@pytest.mark.unit
@pytest.mark.parametrize("chunk_tokens", [1, 5, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_vocab_autograd(chunk_tokens, temperature):
    """Contract: any chunking gives the full-vocabulary values and gradients (hidden and head weight) within
    1e-6 in fp32."""
    x = _inputs()
    hidden, weight = x["hidden"].clone().requires_grad_(True), x["weight"].clone().requires_grad_(True)
    lp, ent = linear_logprobs_entropy(hidden, weight, x["target"], temperature=temperature, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad(_loss(lp, ent, x), (hidden, weight))
    ref_h, ref_w = x["hidden"].clone().requires_grad_(True), x["weight"].clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_h @ ref_w.t(), x["target"], temperature)
    ref_grads = torch.autograd.grad(_loss(ref_lp, ref_ent, x), (ref_h, ref_w))
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **GRAD_TOL)


@pytest.mark.unit
def test_bf16_head_gets_an_fp32_log_softmax():
    """Contract: a bf16 head gives fp32 log-probs and entropy equal to the fp32 math on its (upcast) bf16 logits,
    and bf16 gradients."""
    x = _inputs(1)
    hidden, weight = x["hidden"].bfloat16().requires_grad_(True), x["weight"].bfloat16().requires_grad_(True)
    lp, ent = linear_logprobs_entropy(hidden, weight, x["target"], chunk_tokens=4)
    assert lp.dtype == ent.dtype == torch.float32
    ref_lp, ref_ent = _reference((hidden @ weight.t()).float(), x["target"], 1.0)
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    _loss(lp, ent, x).backward()
    for t in (hidden, weight):
        assert t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad.float()).all()


def _saved_for_backward(fn) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.unit
def test_memory_kept_for_backward_is_per_token():
    """Contract: only the head's own inputs (hidden, weight) and O(tokens) fp32 numbers are kept for backward,
    where the textbook autograd keeps (tokens, V) tensors."""
    x = _inputs(2)
    n_tok = B * T
    hidden, weight = x["hidden"].requires_grad_(True), x["weight"].requires_grad_(True)
    saved = _saved_for_backward(lambda: linear_logprobs_entropy(hidden, weight, x["target"], chunk_tokens=4))
    big = [t for t in saved if t.numel() > n_tok]
    assert all(t.data_ptr() in (hidden.data_ptr(), weight.data_ptr()) for t in big), [t.shape for t in big]
    assert sum(t.numel() for t in saved if t.numel() <= n_tok) <= 5 * n_tok  # 3 fp32 stats, target, mask

    saved = _saved_for_backward(lambda: _reference(hidden @ weight.t(), x["target"], 1.0))
    assert any(t.numel() >= n_tok * V for t in saved)


def _tp2_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = _inputs(3)
    part = slice(rank * V // 2, (rank + 1) * V // 2)
    hidden, weight = x["hidden"].clone().requires_grad_(True), x["weight"][part].clone().requires_grad_(True)
    lp, ent = linear_logprobs_entropy(hidden, weight, x["target"], dist.group.WORLD, temperature=0.7, chunk_tokens=5)
    _loss(lp, ent, x).backward()
    # numpy, not tensors: torch would share tensor storage that dies with this process
    q.put((rank, [t.detach().numpy() for t in (lp, ent, hidden.grad, weight.grad)]))
    dist.destroy_process_group()


@pytest.mark.integration
def test_tp2_equals_full_vocab_autograd():
    """Contract: with the vocabulary split over 2 gloo ranks, every rank gets the full-vocabulary values, each
    rank its slice of the head-weight gradient, and the ranks' hidden gradients sum to the full one (what
    Megatron's column-parallel layer all-reduces), within 1e-6 in fp32."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_tp2_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    x = _inputs(3)
    hidden, weight = x["hidden"].clone().requires_grad_(True), x["weight"].clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(hidden @ weight.t(), x["target"], 0.7)
    _loss(ref_lp, ref_ent, x).backward()
    hidden_grad = torch.zeros_like(hidden)
    for rank, got in results.items():
        lp, ent, h_grad, w_grad = map(torch.from_numpy, got)
        part = slice(rank * V // 2, (rank + 1) * V // 2)
        for a, b in ((lp, ref_lp), (ent, ref_ent)):
            torch.testing.assert_close(a, b.detach(), **TOL)
        torch.testing.assert_close(w_grad, weight.grad[part], **GRAD_TOL)
        hidden_grad += h_grad
    torch.testing.assert_close(hidden_grad, hidden.grad, **GRAD_TOL)
