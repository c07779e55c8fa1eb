"""Packed sequences (THD): packing padded rows, the packed attention, and a model fed packs."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_workers import attention
from megatron_workers.packing import pack

pytestmark = pytest.mark.unit


def test_pack_keeps_real_tokens_in_order_with_positions_per_sequence():
    """Contract: the pack is every real token, row by row; cu_seqlens marks the rows; positions restart at 0 per
    row; `index` maps each real (row, column) to its place in the pack and padding to -1."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [1, 2, 3, 4, 0, 0], [0, 9, 8, 0, 0, 0]])  # (3, 6)
    mask = (ids > 0).long()
    p = pack(ids, mask)
    assert p.ids.tolist() == [[5, 6, 7, 1, 2, 3, 4, 9, 8]]
    assert p.cu_seqlens.tolist() == [0, 3, 7, 9] and p.cu_seqlens.dtype == torch.int32
    assert p.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]
    assert p.max_seqlen == 4
    assert p.index[0].tolist() == [-1, -1, 0, 1, 2, -1]
    assert (p.ids[0][p.index[mask.bool()]] == ids[mask.bool()]).all()


def test_pack_pads_to_the_sequence_parallel_multiple_with_a_sequence_of_its_own():
    """Contract: with `multiple` (the TP size under sequence parallelism) the pack's length is a multiple of it; the
    padding is one last sequence of token 0 with its own positions, and no row's index points into it."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [1, 2, 3, 4, 0, 0], [0, 9, 8, 0, 0, 0]])  # (3, 6), 9 real tokens
    mask = (ids > 0).long()
    p = pack(ids, mask, multiple=4)
    assert p.ids.tolist() == [[5, 6, 7, 1, 2, 3, 4, 9, 8, 0, 0, 0]]
    assert p.cu_seqlens.tolist() == [0, 3, 7, 9, 12]
    assert p.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert p.index.max() == 8 and torch.equal(p.index, pack(ids, mask).index)
    assert pack(ids[:2], mask[:2], multiple=7).cu_seqlens.tolist() == [0, 3, 7]  # 7 tokens: no padding


def dense_reference(q, k, v, cu, scale):
    """Causal attention per segment with explicit scores and GQA by repetition: `(t, h, d)`."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = q[lo:hi], k[lo:hi].repeat_interleave(groups, 1), v[lo:hi].repeat_interleave(groups, 1)
        scores = torch.einsum("shd,thd->hst", qs, ks) * scale  # (h, s, s)
        s = hi - lo
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        out[lo:hi] = torch.einsum("hst,thd->shd", scores.softmax(-1), vs)
    return out


def test_segment_attention_is_causal_within_each_sequence_with_gqa():
    """Contract: the CPU kernel (installed by cpu_compat for this test session) equals explicit causal attention
    inside each segment, query heads sharing their group's key/value head, and no token sees another sequence."""
    assert attention.KERNEL is attention.segment_sdpa  # cpu_compat's adaptation on a machine without a GPU
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    q, k, v = (torch.randn(13, h, 8, generator=g) for h in (4, 2, 2))  # 4 query heads, 2 groups
    scale = 1 / math.sqrt(8)
    out = attention.segment_sdpa(q, k, v, cu, 7, scale)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu, scale), rtol=0, atol=1e-6)
    k2, v2 = k.clone(), v.clone()
    k2[6:], v2[6:] = 100.0, 100.0  # a change in the third sequence
    torch.testing.assert_close(attention.segment_sdpa(q, k2, v2, cu, 7, scale)[:6], out[:6], rtol=0, atol=0)


def _fake_varlen(calls: list, gqa: bool, causal_key: str):
    """A `varlen_attn` of one torch release's signature, computing with `dense_reference` and recording its calls."""

    def check(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, enable_gqa):
        assert cu_q is cu_k and max_q == max_k and causal and (enable_gqa or k.shape[1] == q.shape[1])
        calls.append((k.shape[1], enable_gqa))
        return dense_reference(q, k, v, cu_q, scale)

    if causal_key == "window_size" and gqa:
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
            return check(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size == (-1, 0), enable_gqa)
    elif causal_key == "window_size":
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return check(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size == (-1, 0), False)
    else:
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):
            return check(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, False)
    return fake


@pytest.mark.parametrize("gqa, causal_key", [(True, "window_size"), (False, "window_size"), (False, "is_causal")])
def test_flash_varlen_follows_the_installed_signature(monkeypatch, gqa, causal_key):
    """Contract: the GPU kernel calls `varlen_attn` the way the installed torch takes it (causal by `window_size`
    or `is_causal`; grouped key / value heads by `enable_gqa`, or repeated to the query heads where it has none) and
    gives causal attention within each segment. Fakes of each signature stand in for the CUDA kernel here; fp32
    input takes the per-segment path."""
    import torch.nn.attention.varlen as varlen

    calls: list = []
    monkeypatch.setattr(varlen, "varlen_attn", _fake_varlen(calls, gqa, causal_key))
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    q, k, v = (torch.randn(13, h, 8, generator=g).bfloat16() for h in (4, 2, 2))
    out = attention.flash_varlen(q, k, v, cu, 7, 0.3)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu, 0.3), rtol=0, atol=0)
    assert calls == [(2, True)] if gqa else calls == [(4, False)]
    attention.flash_varlen(q.float(), k.float(), v.float(), cu, 7, 0.3)
    assert len(calls) == 1, "fp32 input must not reach the Flash-Attention kernel"


def test_packed_attention_refuses_unpacked_input():
    """Contract: the model's core attention needs THD packed_seq_params; a padded call fails naming the helper."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, kv_channels=8, attention_dropout=0.0)
    layer = attention.PackedAttention(cfg, 1, AttnMaskType.causal, "self")
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="packed_seq_params"):
        layer(q, q, q, None)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    assert layer(q, q, q, None, packed_seq_params=attention.packed_seq_params(cu, 4)).shape == (4, 16)


def test_a_row_gets_the_same_logits_alone_or_packed_with_others(world_of_one, tiny_model_dir):
    """Contract: a GPTModel fed a pack computes each sequence independently: a row's logits are the same
    (within fp32 rounding) whether it is packed alone or after other rows."""
    from megatron_workers import model as mmodel

    hf_config, state = mmodel.load_hf_checkpoint(tiny_model_dir)
    gpt = mmodel.build_gpt_model(hf_config).eval()
    mmodel.load_hf_weights(gpt, state, hf_config)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 100, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0
    mask[1, 7:] = 0

    def logits(rows):
        p = pack(ids[rows], mask[rows])
        with torch.no_grad():
            return gpt(p.ids, p.positions, None,
                       packed_seq_params=attention.packed_seq_params(p.cu_seqlens, p.max_seqlen))[0]  # (t, V)

    together = logits([0, 1, 2])
    alone = logits([2])
    torch.testing.assert_close(together[-10:], alone, rtol=0, atol=1e-5)
