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

- The tokenizer is a 1024-id byte-level BPE trained here, deterministically, on text this
  module generates (digits, arithmetic, GSM8K-like word problems, JSON, tool calls, Python,
  chat words); it does not depend on ``seed``, only the weights do. Its pipeline is Qwen2's
  (NFC normalizer, Qwen's split regex with one digit per token, byte-level), because
  transformers 5 rebuilds exactly that pipeline for every ``model_type: qwen2`` checkpoint
  whatever ``tokenizer.json`` says; writing the same one keeps the raw ``tokenizers`` file,
  ``AutoTokenizer`` and SGLang in agreement. So decode(encode(s)) == NFC(s) for any unicode
  string (== s for NFC text), as with Qwen.
- The chat template follows Qwen2.5's (hermes tool calls, grouped ``<tool_response>`` blocks) but
  adds no default system prompt, accepts tool-call arguments as a dict or a JSON string, and
  renders the tool name with ``tojson``. ``--compact-tools`` writes a template whose tools block
  is one ``name(arg, ...): description`` line per tool, without the instructions and the JSON
  schema (about 150 tokens of this tokenizer fewer): a small model learns the call format from
  its demonstrations, and short prompts train faster.
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
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Control tokens (special=True): dropped by ``decode(..., skip_special_tokens=True)``."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added tokens with special=False, as in Qwen2.5: kept in decoded text for tool-call parsers."""

TOKENIZER_SIZE = 1024
"""len(tokenizer): BPE vocabulary (256 bytes + merges) plus the added tokens."""
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""``--arch`` -> the HF architecture written to config.json."""
VOCAB_MULTIPLE = 64
"""config.json's vocab_size is len(tokenizer) rounded up to this."""
INIT_STD = 0.2
"""Default std of the normal init of every matrix and bias; large enough that greedy output depends on the input."""
TRAINING_INIT_STD = 0.02
"""Std for a tiny model meant to be trained (Qwen's initializer_range)."""
_CORPUS_SEED = 1234
"""Seed of the generated tokenizer-training text (fixed: the tokenizer does not follow ``seed``)."""
# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, spaces.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5-style chat template (hermes tool calls); see the module docstring for departures.
_TOOLS_BLOCK = """\
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
"""
# The compact variant: the system line and one `name(arg, ...): description` line per tool (a small model learns
# the call format from its demonstrations).
_COMPACT_TOOLS_BLOCK = """\
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}{{- messages[0].content + '\\n' -}}{%- endif -%}
    {{- '<tools>' -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {{- '\\n' + fn.name + '(' + ((fn.parameters or {}).properties or {}) | list | join(', ') + '): '
            + (fn.description or '') -}}
    {%- endfor -%}
    {{- '\\n</tools><|im_end|>\\n' -}}
"""
_TEMPLATE = """\
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
@TOOLS_BLOCK@\
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant' -}}
        {%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}
        {%- for tool_call in message.tool_calls -%}
            {%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
            {{- '\\n<tool_call>\\n{\"name\": ' + (tool_call.name | tojson) + ', \"arguments\": ' -}}
            {%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}
            {%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
CHAT_TEMPLATE = _TEMPLATE.replace("@TOOLS_BLOCK@", _TOOLS_BLOCK)
"""The default template: Qwen2.5's tools block, word for word."""
COMPACT_CHAT_TEMPLATE = _TEMPLATE.replace("@TOOLS_BLOCK@", _COMPACT_TOOLS_BLOCK)
"""Tools block as one signature line per tool, no instructions (~150 fewer prompt tokens): `--compact-tools`."""


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


# ----------------------------------------------------------------------------- tokenizer corpus

_NAMES = ("Natalia", "Weng", "Betty", "James", "Mark", "Albert", "Ken", "Alexis", "Tina", "Maria",
          "John", "Sam", "Lily", "Omar", "Priya", "Carlos", "Mei", "Tom", "Ana", "Julie")
_ITEMS = ("apples", "clips", "cookies", "books", "pencils", "marbles", "eggs", "tickets", "shirts",
          "cupcakes", "stickers", "pages", "dollars", "miles", "hours", "boxes", "cards", "flowers")
_VERBS = ("sold", "bought", "baked", "read", "found", "gave away", "collected", "earned", "made")
_KEYS = ("name", "arguments", "answer", "code", "query", "id", "type", "value", "result", "items",
         "description", "parameters", "properties", "required", "function", "content", "role",
         "score", "status", "error", "output", "count", "total", "price", "city", "date")
_WORDS = ("the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "how", "many", "much",
          "each", "what", "does", "did", "has", "have", "total", "more", "than", "less", "half",
          "twice", "times", "per", "week", "day", "month", "year", "left", "altogether", "answer",
          "step", "first", "then", "so", "because", "let", "us", "think", "we", "you", "I", "can")
_CHAT = ("system", "user", "assistant", "tool", "You are a helpful assistant.",
         "Let's think step by step.", "The answer is", "Please reason step by step, and put your "
         "final answer after \"####\".", "You must call the `calc_gsm8k_reward` tool after "
         "reasoning.", "Your answer is correct!", "Your answer is incorrect.", "Current parsed "
         "answer=", "reward=", "Hello! How can I help you today?", "Thank you.", "Sure, here it is:",
         "# Tools", "You may call one or more functions to assist with the user query.",
         "You are provided with function signatures within XML tags:", "For each function call, "
         "return a json object with function name and arguments within XML tags:")
_TOOLS = ("calc_gsm8k_reward", "code_interpreter", "python", "search", "get_weather", "calculator")


def _word_problem(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b = rng.randint(2, 99), rng.randint(2, 60)
    verb = rng.choice(_VERBS)
    total = a + b
    return (
        f"{name} {verb} {a} {item} on Monday and {b} {item} on Tuesday. {other} {verb} twice as many "
        f"{item} as {name}. How many {item} did {name} and {other} {verb} altogether?\n"
        f"{name}: {a} + {b} = <<{a}+{b}={total}>>{total} {item}.\n"
        f"{other}: {total} * 2 = <<{total}*2={2 * total}>>{2 * total} {item}.\n"
        f"Altogether: {total} + {2 * total} = <<{total}+{2 * total}={3 * total}>>{3 * total}.\n"
        f"#### {3 * total}"
    )


def _arithmetic(rng: random.Random) -> str:
    a, b, c = rng.randint(0, 999), rng.randint(1, 99), rng.randint(1, 9)
    op = rng.choice("+-*/")
    value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 2)}[op]
    return rng.choice((
        f"{a} {op} {b} = {value}",
        f"({a} {op} {b}) * {c} = {round(value * c, 2)}",
        f"${a}.{b:02d} + ${c}.50 = ${round(a + b / 100 + c + 0.5, 2)}",
        f"{b}% of {a} is {round(a * b / 100, 2)}",
        f"x = {a} / {b} = {value if op == '/' else round(a / b, 3)}",
    ))


def _json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-1000, 100000)
    if kind == 1:
        return round(rng.uniform(-100, 100), rng.randint(1, 3))
    if kind == 2:
        return rng.choice((True, False, None))
    if kind in (3, 4):
        return " ".join(rng.choices(_WORDS + _ITEMS + _NAMES, k=rng.randint(1, 5)))
    if kind == 5:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {k: _json_value(rng, depth + 1) for k in rng.sample(_KEYS, rng.randint(1, 4))}


def _json_doc(rng: random.Random) -> str:
    obj = {k: _json_value(rng) for k in rng.sample(_KEYS, rng.randint(1, 5))}
    return json.dumps(obj, indent=rng.choice((None, 2)), separators=rng.choice(((", ", ": "), (",", ":"))))


def _tool_text(rng: random.Random) -> str:
    name = rng.choice(_TOOLS)
    if rng.random() < 0.5:
        args = {"answer": str(rng.randint(0, 9999))} if name == "calc_gsm8k_reward" else \
            {"code": f"print({rng.randint(1, 99)} * {rng.randint(1, 99)})"}
        return json.dumps({"name": name, "arguments": args})
    schema = {"type": "function", "function": {
        "name": name, "description": f"A tool that computes the {rng.choice(_KEYS)} of a query.",
        "parameters": {"type": "object", "properties": {
            k: {"type": rng.choice(("string", "number", "integer", "boolean")),
                "description": f"The {k} to use."} for k in rng.sample(_KEYS, 2)},
            "required": [rng.choice(_KEYS)]}}}
    return json.dumps(schema)


def _python_snippet(rng: random.Random) -> str:
    n, k = rng.randint(1, 50), rng.randint(2, 9)
    fn = rng.choice(("total", "compute", "solve", "count_items", "main"))
    return rng.choice((
        f"def {fn}(n):\n    result = 0\n    for i in range(n):\n        result += i * {k}\n"
        f"    return result\n\nprint({fn}({n}))\n",
        f"import math\nx = math.sqrt({n * n})\nif x > {k}:\n    print(\"big\", x)\nelse:\n"
        f"    print('small')\n",
        f"items = [{', '.join(str(rng.randint(0, 99)) for _ in range(k))}]\n"
        f"total = sum(items) / len(items)\nprint(f\"mean={{total:.2f}}\")\n",
        f"class Counter:\n    def __init__(self):\n        self.count = {n}\n\n    def add(self, k={k}):\n"
        f"        self.count += k\n        return self.count\n",
    ))


def _chat_text(rng: random.Random) -> str:
    return "\n".join(rng.choice(_CHAT) for _ in range(rng.randint(1, 4)))


def tokenizer_corpus(num_docs: int = 6000) -> Iterator[str]:
    """The deterministic text the tokenizer is trained on (same documents on every call)."""
    rng = random.Random(_CORPUS_SEED)
    makers = (_word_problem, _arithmetic, _json_doc, _tool_text, _python_snippet, _chat_text)
    for i in range(num_docs):
        yield makers[i % len(makers)](rng)


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE and add the special and tool tokens (ids after the BPE vocab)."""
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    n_added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    trainer = BpeTrainer(
        vocab_size=TOKENIZER_SIZE - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def _tokenizer_config(tokenizer: Tokenizer, spec: TinyModelSpec, chat_template: str) -> dict:
    added = {}
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        added[str(tokenizer.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": token in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": spec.max_position_embeddings,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


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
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer, spec, template))
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
