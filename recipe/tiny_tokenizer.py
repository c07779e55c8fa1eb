"""The tiny model's tokenizer: a deterministic byte-level BPE trained on generated text, its special and tool tokens,
and the Qwen2.5-style chat templates (`recipe.tiny_model` writes them beside the weights).

Where it departs from Qwen2.5's:

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
"""

from __future__ import annotations

import json
import random
from typing import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Control tokens (special=True): dropped by ``decode(..., skip_special_tokens=True)``."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added tokens with special=False, as in Qwen2.5: kept in decoded text for tool-call parsers."""

TOKENIZER_SIZE = 1024
"""len(tokenizer): BPE vocabulary (256 bytes + merges) plus the added tokens."""
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


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int, chat_template: str) -> dict:
    """tokenizer_config.json for `tokenizer` (transformers' Qwen2Tokenizer settings) with `chat_template`."""
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
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
