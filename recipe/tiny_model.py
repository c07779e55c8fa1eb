"""Tiny-model kit: write a small, seeded, HF-format Qwen2 or Qwen3 checkpoint with its own tokenizer.

Nothing can be downloaded on CI or developer machines, so every test that needs a model
builds one here: ``config.json``, ``model.safetensors`` and ``generation_config.json`` for a
Qwen2- (default) or Qwen3-architecture causal LM, plus ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` for a byte-level BPE tokenizer with a Qwen2.5-style, tool-aware
chat template. The result loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` and with
SGLang's ``Engine`` like any real checkpoint::

    python -m recipe.tiny_model --out /tmp/tiny --layers 2 --hidden 64 --heads 4 --kv-heads 2
    python -m recipe.tiny_model --arch qwen3 --out /tmp/tiny-qwen3

``--arch qwen3`` writes Qwen3's layer: RMSNorm on each q and k head (``q_norm`` / ``k_norm``), no
QKV bias, and a head dim that is not hidden/heads (default 2 * hidden/heads, the ratio of
Qwen3-0.6B: hidden 1024, 16 heads, head_dim 128); ``--head-dim`` sets it for either architecture.

Where it departs from a real Qwen2.5 checkpoint:

- The tokenizer and chat template are the kit's own (`recipe.tiny_tokenizer`).
- Every tensor is random, including biases and RMSNorm weights (Qwen initialises those to 0
  and 1), so that a conversion that drops or swaps one of them shows up in parity tests; the
  init std (0.2) is larger than Qwen's 0.02 so that a 64-wide random model's greedy output
  varies with its input instead of repeating one token. That init is for tests: a model meant to
  be trained (the CPU preset) takes ``--init-std 0.02``, Qwen's own ``initializer_range``; at 0.2
  a tiny model barely learns to copy numbers.

The weights are float32 (``dtype`` in config.json). SGLang's ``dtype="auto"`` downcasts float32
checkpoints to float16, so compare its logprobs with transformers' only under ``dtype="float32"``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from recipe.tiny_tokenizer import (
    CHAT_TEMPLATE,
    COMPACT_CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    build_tokenizer,
    tokenizer_config,
)

logger = logging.getLogger(__name__)

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""``--arch`` -> the HF architecture written to config.json."""
VOCAB_MULTIPLE = 64
"""config.json's vocab_size is len(tokenizer) rounded up to this."""
INIT_STD = 0.2
"""Default std of the normal init of every matrix and bias; large enough that greedy output depends on the input."""
TRAINING_INIT_STD = 0.02
"""Std for a tiny model meant to be trained (Qwen's initializer_range)."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; validated on construction (messages name the CLI flags)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    seed: int = 0
    init_std: float = INIT_STD
    arch: str = "qwen2"
    """"qwen2" (QKV bias) or "qwen3" (q/k RMSNorm, no bias, head dim not hidden/heads by default)."""
    head_dim: int | None = None
    """Per-head width; None: hidden/heads for qwen2, 2 * hidden/heads for qwen3."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.rope_theta <= 0:
            raise ValueError(f"{_flag('rope_theta')} must be > 0, got {self.rope_theta}")
        if self.init_std <= 0:
            raise ValueError(f"{_flag('init_std')} must be > 0, got {self.init_std}")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{_flag('arch')}={self.arch!r} is not one of {sorted(ARCHITECTURES)}")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"{_flag('head_dim')} must be >= 1, got {self.head_dim}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"{_flag('heads')}={self.heads} does not divide {_flag('hidden')}={self.hidden}; "
                f"pick a head count that divides the hidden size"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{_flag('kv_heads')}={self.kv_heads} does not divide {_flag('heads')}={self.heads}; "
                f"pick a KV head count that divides the attention head count"
            )
        if self.attn_head_dim % 2:
            raise ValueError(
                f"head dim {self.attn_head_dim} ({_flag('head_dim')}, else from {_flag('hidden')}/{_flag('heads')}) "
                f"is odd; RoPE needs an even head dim, change --head-dim, --hidden or --heads"
            )

    @property
    def attn_head_dim(self) -> int:
        """The head dim the checkpoint gets (`head_dim`, or its per-architecture default)."""
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden // self.heads * (2 if self.arch == "qwen3" else 1)


def _flag(field: str) -> str:
    """``kv_heads`` -> ``kv_heads (--kv-heads)``: errors name both the argument and the CLI flag."""
    return f"{field} (--{field.replace('_', '-')})"


# ----------------------------------------------------------------------------- model

def padded_vocab_size(tokenizer_size: int) -> int:
    """Embedding rows: ``tokenizer_size`` rounded up to a multiple of ``VOCAB_MULTIPLE``."""
    return math.ceil(tokenizer_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _model_config(spec: TinyModelSpec, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    config = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "attention_dropout": 0.0,
        "bos_token_id": pad_id,  # as in Qwen2.5: <|endoftext|>; the tokenizer adds no BOS
        "dtype": "float32",
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.layers,
        "model_type": spec.arch,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "pad_token_id": pad_id,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "rope_theta": spec.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    if spec.head_dim is not None or spec.arch == "qwen3":
        config["head_dim"] = spec.attn_head_dim
    if spec.arch == "qwen3":
        config["attention_bias"] = False
    return config


def init_weights(spec: TinyModelSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    """Seeded random fp32 weights under HF Qwen2/Qwen3 names (``lm_head`` omitted when tied)."""
    gen = torch.Generator().manual_seed(spec.seed)
    h, hd, i = spec.hidden, spec.attn_head_dim, spec.intermediate

    def normal(*shape: int, std: float = spec.init_std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(h, std=0.1)  # (H,) around 1, not exactly 1: catches dropped norms

    weights = {"model.embed_tokens.weight": normal(vocab_size, h)}  # (V, H)
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        bias = spec.arch == "qwen2"  # drawn right after its weight, so a seed's Qwen2 weights never change
        weights[p + "input_layernorm.weight"] = norm_weight()
        for proj, rows in (("q", spec.heads * hd), ("k", spec.kv_heads * hd), ("v", spec.kv_heads * hd)):
            weights[p + f"self_attn.{proj}_proj.weight"] = normal(rows, h)  # (A*D or K*D, H)
            if bias:
                weights[p + f"self_attn.{proj}_proj.bias"] = normal(rows)
        if not bias:  # qwen3: RMSNorm over each head's D features of q and k
            weights.update({
                p + "self_attn.q_norm.weight": 1.0 + normal(hd, std=0.1),  # (D,)
                p + "self_attn.k_norm.weight": 1.0 + normal(hd, std=0.1),
            })
        weights.update({
            p + "self_attn.o_proj.weight": normal(h, spec.heads * hd),  # (H, A*D)
            p + "post_attention_layernorm.weight": norm_weight(),
            p + "mlp.gate_proj.weight": normal(i, h),  # (I, H)
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),  # (H, I)
        })
    weights["model.norm.weight"] = norm_weight()
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(vocab_size, h)  # (V, H)
    return weights


# ----------------------------------------------------------------------------- writer

def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    init_std: float = INIT_STD,
    compact_tools: bool = False,
    arch: str = "qwen2",
    head_dim: int | None = None,
) -> Path:
    """Write a seeded HF Qwen2 (or, with `arch="qwen3"`, Qwen3) checkpoint + tokenizer to ``out_dir`` and return its path.

    `compact_tools` writes `COMPACT_CHAT_TEMPLATE` (tools block without the instructions) instead
    of `CHAT_TEMPLATE`. The same arguments give byte-identical files. Raises ``ValueError`` naming the argument
    (and its CLI flag) when the shape is inconsistent, e.g. ``heads`` not dividing ``hidden``.
    """
    spec = TinyModelSpec(layers, hidden, heads, kv_heads, intermediate, max_position_embeddings,
                         rope_theta, tie_word_embeddings, seed, init_std, arch, head_dim)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    eos_id, pad_id = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)
    vocab_size = padded_vocab_size(tokenizer.get_vocab_size(with_added_tokens=True))

    tokenizer.save(str(out / "tokenizer.json"))
    template = COMPACT_CHAT_TEMPLATE if compact_tools else CHAT_TEMPLATE
    _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, spec.max_position_embeddings, template))
    _write_json(out / "special_tokens_map.json", {
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]), "eos_token": IM_END, "pad_token": ENDOFTEXT,
    })
    _write_json(out / "config.json", _model_config(spec, vocab_size, eos_id, pad_id))
    _write_json(out / "generation_config.json", {
        "bos_token_id": pad_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
    })
    save_file(init_weights(spec, vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("wrote tiny %s checkpoint (%s, vocab %d) to %s", ARCHITECTURES[spec.arch], spec, vocab_size, out)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m recipe.tiny_model --out DIR [--layers N --hidden H ...]``."""
    defaults = TinyModelSpec()
    parser = argparse.ArgumentParser(prog="python -m recipe.tiny_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to write the checkpoint into")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default=defaults.arch,
                        help="qwen2 (QKV bias) or qwen3 (q/k norms, no bias, head dim 2 * hidden/heads)")
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim, metavar="D",
                        help="per-head width (default: hidden/heads for qwen2, 2 * hidden/heads for qwen3)")
    parser.add_argument("--layers", type=int, default=defaults.layers, metavar="N", help="decoder layers")
    parser.add_argument("--hidden", type=int, default=defaults.hidden, metavar="H", help="hidden size")
    parser.add_argument("--heads", type=int, default=defaults.heads, metavar="A", help="attention heads, divides H")
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads, metavar="K", help="KV heads, divides A")
    parser.add_argument("--intermediate", type=int, default=defaults.intermediate, metavar="I", help="MLP width")
    parser.add_argument("--max-position-embeddings", type=int, default=defaults.max_position_embeddings,
                        metavar="P", help="context length written to config.json")
    parser.add_argument("--rope-theta", type=float, default=defaults.rope_theta, metavar="THETA", help="RoPE base")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="share the embedding and the LM head")
    parser.add_argument("--seed", type=int, default=defaults.seed, metavar="S", help="weight init seed")
    parser.add_argument("--init-std", type=float, default=defaults.init_std, metavar="STD",
                        help=f"std of the random init (default {INIT_STD}, for parity tests; "
                             f"{TRAINING_INIT_STD} for a model you train)")
    parser.add_argument("--compact-tools", action="store_true",
                        help="chat template whose tools block is the schemas only, without the instructions")
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = write_tiny_checkpoint(args.pop("out"), **args)
    except ValueError as err:
        parser.error(str(err))
    logger.info("done: %s", out)


if __name__ == "__main__":
    main()
