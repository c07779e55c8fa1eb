"""HF <-> Megatron conversion in one process (TP = PP = 1, gloo): config checks, layout refusal,
bad-checkpoint errors, and exact round trips for Qwen2 (tied and untied, QKV bias), Llama and Qwen3
(q/k norms, head_dim != hidden/heads)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_workers import adapters, check_parity, parallel
from megatron_workers import model as conversion
from megatron_workers.adapters.base import local_rules
from megatron_workers.attention import packed_seq_params
from megatron_workers.packing import pack

pytestmark = pytest.mark.unit

TINY = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, intermediate_size=128)
QWEN3_HEAD_DIM = 32  # != hidden_size / num_attention_heads = 16, as in real Qwen3 models


def write_hf_checkpoint(out_dir: Path, *, tied: bool, family: str = "qwen2", seed: int = 0) -> Path:
    """Save a seeded random HF checkpoint; biases and norm weights are made non-trivial so that a
    wrong QKV interleaving or a swapped norm shows up in the logits."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tied, architectures=["Qwen2ForCausalLM"]))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=QWEN3_HEAD_DIM, tie_word_embeddings=tied,
                                             architectures=["Qwen3ForCausalLM"]))
    else:
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied, rope_theta=5e5,
                                             architectures=["LlamaForCausalLM"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return out_dir


def _qwen2_config(**changes):
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY, **changes})


@pytest.mark.parametrize(
    "config, field",
    [
        ({**TINY, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "architectures"),
        ({**TINY, "model_type": "gemma"}, "model_type"),
        ({**TINY, "model_type": "qwen3", "rope_theta": 1e4, "attention_bias": True}, "attention_bias"),
        ({**TINY, "model_type": "qwen3", "rope_theta": 1e4, "layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({**TINY, "model_type": "llama", "rope_theta": 1e4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
         "rope_scaling"),
        ({**TINY, "model_type": "qwen2", "rope_theta": 1e4, "use_sliding_window": True}, "use_sliding_window"),
        ({**TINY, "model_type": "llama", "rope_theta": 1e4, "attention_bias": True}, "attention_bias"),
        ({**TINY, "model_type": "qwen2", "rope_theta": 1e4, "hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_config_names_the_field(config, field):
    """Contract: an architecture the conversion cannot reproduce is refused with the config field's name."""
    with pytest.raises(ValueError, match=field):
        adapters.read_decoder_shape(config)


def test_config_maps_onto_megatron():
    """Contract: GQA groups, head dim, QKV bias, RMSNorm eps and SwiGLU reach TransformerConfig."""
    cfg = conversion.hf_to_transformer_config(_qwen2_config(rms_norm_eps=1e-5))
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.ffn_hidden_size) == (2, 16, 128)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.gated_linear_unit
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    assert not cfg.qk_layernorm


def test_qwen3_config_maps_onto_megatron():
    """Contract: Qwen3's explicit head_dim becomes kv_channels (not hidden/heads), q/k norms become
    qk_layernorm, and it has no QKV bias; its q/k norm tensors are (head_dim,) in the HF plan."""
    from transformers import Qwen3Config

    config = Qwen3Config(**TINY, head_dim=QWEN3_HEAD_DIM, architectures=["Qwen3ForCausalLM"])
    cfg = conversion.hf_to_transformer_config(config)
    assert (cfg.kv_channels, cfg.num_query_groups) == (QWEN3_HEAD_DIM, 2)
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and not cfg.add_bias_linear
    shapes = adapters.hf_tensor_shapes(config)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (QWEN3_HEAD_DIM,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * QWEN3_HEAD_DIM, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 4 * QWEN3_HEAD_DIM)
    assert not any(name.endswith("bias") for name in shapes)


@pytest.mark.parametrize(
    "tp, pp, message",
    [
        (3, 1, "num_attention_heads=4 is not divisible by tp=3"),
        (4, 1, "num_key_value_heads=2 is not divisible by tp=4"),
        (1, 3, "num_hidden_layers=4 is not divisible by pp=3"),
    ],
)
def test_layout_refused_with_field_and_fix(tp, pp, message):
    """Contract: a TP/PP layout the model cannot take is refused, naming the field and what to change."""
    with pytest.raises(ValueError, match=message) as err:
        parallel.validate_layout(_qwen2_config(), tp, pp)
    assert "choose a" in str(err.value)


def test_layout_accepted():
    """Contract: layouts that divide heads, KV heads, FFN, vocab and layers pass."""
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]:
        parallel.validate_layout(_qwen2_config(), tp, pp)


def test_parity_refuses_bad_layout_before_spawning(tmp_path, monkeypatch):
    """Contract: the parity CLI validates the layout before any process starts."""
    ckpt = write_hf_checkpoint(tmp_path / "ckpt", tied=False)

    def no_spawn(*args, **kwargs):
        raise AssertionError("a process was spawned for an invalid layout")

    monkeypatch.setattr(check_parity.mp, "spawn", no_spawn)
    with pytest.raises(ValueError, match="pp=3"):
        check_parity.run_parity(ckpt, tp=1, pp=3)


def test_state_dict_check_names_missing_and_misshaped_tensors():
    """Contract: a checkpoint that does not match its config fails with the HF tensor names and shapes."""
    config = _qwen2_config()
    shapes = adapters.hf_tensor_shapes(config)
    state = {name: torch.zeros(shape) for name, shape in shapes.items()}
    del state["model.layers.3.mlp.up_proj.weight"]
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    with pytest.raises(ValueError) as err:
        adapters.check_hf_state_dict(state, config)
    text = str(err.value)
    assert "missing tensor model.layers.3.mlp.up_proj.weight (expected shape (128, 64))" in text
    assert "model.layers.1.self_attn.k_proj.weight: expected shape (32, 64), got (48, 64)" in text


@pytest.mark.parametrize("family, tied", [("qwen2", False), ("qwen2", True), ("llama", False), ("qwen3", True)])
def test_roundtrip_and_logits_single_rank(world_of_one, tmp_path, family, tied):
    """Contract: HF -> Megatron -> HF is bit-exact, and Megatron's logits match transformers'
    (right-padded batch, its real tokens packed) within 1e-4 on valid positions."""
    ckpt = write_hf_checkpoint(tmp_path / "ckpt", tied=tied, family=family)
    hf_config, state = conversion.load_hf_checkpoint(ckpt)
    assert ("lm_head.weight" in state) == (not tied)
    gpt = conversion.build_gpt_model(hf_config).eval()
    adapters.load_hf_weights(gpt, state, hf_config)

    exported = adapters.export_hf_state_dict(gpt, hf_config)
    assert list(exported) == list(adapters.hf_tensor_shapes(hf_config))
    assert set(exported) == set(state)
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name

    batch = check_parity.make_batch(256, seed=1)
    packed = pack(batch.input_ids, batch.attention_mask)  # the real tokens, (1, t)
    with torch.no_grad():
        logits = gpt(packed.ids, packed.positions, None,
                     packed_seq_params=packed_seq_params(packed.cu_seqlens, packed.max_seqlen))[0]  # (t, V)
    ref_logits, _ = check_parity.hf_reference(ckpt, batch)
    valid = batch.attention_mask.bool()
    assert (logits - ref_logits[valid]).abs().max().item() < 1e-4


# GPTModel.named_parameters() of a 2-layer Qwen3 (q/k norms, untied head) built from Megatron-Core 0.19's
# TransformerEngine spec, recorded from the spec's definition (TransformerEngine is not installed here):
# input_layernorm and pre_mlp_layernorm are IdentityOp, their weights live in TELayerNormColumnParallelLinear
# (`layer_norm_weight`; RMSNorm has no layer_norm_bias), q/k norms and the final norm are TENorm (`weight`).
TE_QWEN3_NAMES = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"} | {
    f"decoder.layers.{i}.{name}" for i in range(2) for name in (
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "self_attention.linear_proj.weight",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")}


def test_te_spec_names_map_onto_the_same_hf_tensors():
    """Contract: the TransformerEngine spec's parameter names (recorded) are exactly what the adapter plans for a
    TE-built model, and both layouts map the same HF tensors the same way; only the two pre-norms move."""
    shape = adapters.read_decoder_shape({**TINY, "num_hidden_layers": 2, "model_type": "qwen3", "head_dim": 32,
                                         "rope_theta": 1e6, "tie_word_embeddings": False})
    te, local = local_rules(shape, 0, 1, te=True), local_rules(shape, 0, 1)
    assert {r.megatron_name for r in te} == TE_QWEN3_NAMES
    assert [(r.hf_names, r.split) for r in te] == [(r.hf_names, r.split) for r in local]
    moved = {(a.megatron_name, b.megatron_name) for a, b in zip(local, te) if a.megatron_name != b.megatron_name}
    assert moved == {(f"decoder.layers.{i}.{a}", f"decoder.layers.{i}.{b}") for i in range(2) for a, b in (
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))}


def test_a_model_in_the_te_layout_loads_and_exports_exactly(world_of_one, tmp_path):
    """Contract: a model whose pre-norm weights sit where the TE spec keeps them (moved there from a local-spec model:
    TransformerEngine is not installed) is recognised as such, loads every HF tensor into its TE name and exports
    them back bit-exact."""
    ckpt = write_hf_checkpoint(tmp_path / "ckpt", tied=False, family="qwen3")
    hf_config, state = conversion.load_hf_checkpoint(ckpt)
    gpt = conversion.build_gpt_model(hf_config)
    for layer in gpt.decoder.layers:  # the TE layout: each pre-norm's weight on the linear layer after it
        for norm, linear in ((layer.input_layernorm, layer.self_attention.linear_qkv),
                             (layer.pre_mlp_layernorm, layer.mlp.linear_fc1)):
            linear.register_parameter("layer_norm_weight", norm.weight)
            del norm.weight
            norm.register_parameter("weight", None)
    assert adapters.is_te_layout(dict(gpt.named_parameters()))
    adapters.load_hf_weights(gpt, state, hf_config)
    assert torch.equal(gpt.decoder.layers[1].mlp.linear_fc1.layer_norm_weight,
                       state["model.layers.1.post_attention_layernorm.weight"])
    exported = adapters.export_hf_state_dict(gpt, hf_config)
    assert set(exported) == set(state)
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name


def test_load_names_missing_tensor_and_wrong_shape(world_of_one, tmp_path):
    """Contract: loading a checkpoint into Megatron fails before copying, naming the HF tensor."""
    ckpt = write_hf_checkpoint(tmp_path / "ckpt", tied=False)
    hf_config, state = conversion.load_hf_checkpoint(ckpt)
    gpt = conversion.build_gpt_model(hf_config)
    before = {n: p.detach().clone() for n, p in gpt.named_parameters()}

    missing = {k: v for k, v in state.items() if k != "model.layers.2.self_attn.v_proj.bias"}
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.2\.self_attn\.v_proj\.bias"):
        adapters.load_hf_weights(gpt, missing, hf_config)

    wrong = dict(state, **{"model.norm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected shape \(64,\), got \(65,\)"):
        adapters.load_hf_weights(gpt, wrong, hf_config)
    assert all(torch.equal(p, before[n]) for n, p in gpt.named_parameters())


def test_load_checkpoint_without_weights_names_the_fix(tmp_path):
    """Contract: a directory without safetensors weights is refused with what to do."""
    from transformers import Qwen2Config

    Qwen2Config(**TINY).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        conversion.load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("tp", [1, 2])
def test_every_rule_splits_over_tp_and_its_shards_rebuild_the_hf_tensors_exactly(tp):
    """`hf_to_shard` then `shards_to_hf` (which places each shard's `shard_pieces`) is the identity, for every rule
    of a GQA model with a head_dim of its own, QKV biases and q/k norms, untied; and a shard's pieces cover its
    HF tensors' rows or columns exactly once."""
    from megatron_workers.adapters import base

    s = base.decoder_shape(dict(TINY, model_type="qwen3", head_dim=QWEN3_HEAD_DIM, rope_theta=1e6), qkv_bias=True, qk_norm=True)
    shapes = base.hf_tensor_shapes(s)
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(shape, generator=gen) for n, shape in shapes.items()}
    rules = [r for _, r in base.export_plan(s, stages=1)]
    assert {n for r in rules for n in r.hf_names} == set(shapes)
    for rule in rules:
        tensors = [hf[n] for n in rule.hf_names]
        shards = [base.hf_to_shard(rule, tensors, s, tp, r).clone() for r in range(tp)]
        rebuilt = base.shards_to_hf(rule, shards, s)
        assert all(torch.equal(a, b) for a, b in zip(rebuilt, tensors, strict=True)), rule.megatron_name
        covered = [torch.zeros(t.shape, dtype=torch.int64) for t in tensors]
        for r in range(tp if rule.split != "replicated" else 1):
            for i, view, part in base.shard_pieces(rule, shards[r], covered, s, tp, r):
                assert view.shape == part.shape
                view += 1
        assert all(bool((c == 1).all()) for c in covered), rule.megatron_name
