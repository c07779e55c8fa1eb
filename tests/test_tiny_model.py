"""Tests of the tiny-model kit (`recipe.tiny_model`): files, determinism, HF loading, tokenizer, chat template, CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from recipe.tiny_model import (
    VOCAB_MULTIPLE,
    TinyModelSpec,
    init_weights,
    main,
    write_tiny_checkpoint,
)
from recipe.tiny_tokenizer import SPECIAL_TOKENS, TOOL_TOKENS

REPO_ROOT = Path(__file__).resolve().parents[1]
EXPECTED_FILES = {
    "config.json", "generation_config.json", "model.safetensors",
    "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "Score an answer — réponse.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    },
}]
TOOLS_BLOCK = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0], ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def render(tokenizer, messages, tools=None, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


# ----------------------------------------------------------------------------- files


@pytest.mark.unit
def test_writes_a_consistent_qwen2_checkpoint(tiny_model_dir, tokenizer):
    """Contract: the kit writes every file a loader needs, with ids consistent across config and tokenizer."""
    assert EXPECTED_FILES <= {p.name for p in tiny_model_dir.iterdir()}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["vocab_size"] % VOCAB_MULTIPLE == 0 and config["vocab_size"] >= len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config["eos_token_id"] == gen["eos_token_id"] == tokenizer.eos_token_id
    assert config["pad_token_id"] == gen["pad_token_id"] == tokenizer.pad_token_id
    weights = load_file(tiny_model_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert "lm_head.weight" in weights  # untied by default


@pytest.mark.unit
def test_same_arguments_give_identical_bytes(tmp_path):
    """Contract: the checkpoint is a pure function of the arguments (byte-identical files); the seed changes the
    weights only."""
    a = write_tiny_checkpoint(tmp_path / "a", seed=7)
    b = write_tiny_checkpoint(tmp_path / "b", seed=7)
    c = write_tiny_checkpoint(tmp_path / "c", seed=8)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


# ----------------------------------------------------------------------------- model


@pytest.mark.unit
def test_qwen2_weights_are_drawn_in_checkpoint_order():
    """Contract: a seed's Qwen2 weights stay what they were before Qwen3 existed. Each tensor is the next draw from one
    seeded generator in HF order, each projection's bias right after its weight (the CPU preset's documented runs
    start from these weights; reordering the draws silently changes every seed's model)."""
    spec = TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48, seed=3, init_std=0.02)
    weights = init_weights(spec, vocab_size=64)
    gen = torch.Generator().manual_seed(3)
    order = ["model.embed_tokens.weight"]
    for layer in range(2):
        p = f"model.layers.{layer}."
        order += [p + "input_layernorm.weight"]
        order += [p + f"self_attn.{proj}_proj.{kind}" for proj in "qkv" for kind in ("weight", "bias")]
        order += [p + n for n in ("self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    order += ["model.norm.weight", "lm_head.weight"]
    assert sorted(order) == sorted(weights)
    for name in order:
        draw = torch.randn(*weights[name].shape, generator=gen)
        expected = 1.0 + draw * 0.1 if name.endswith("norm.weight") else draw * 0.02
        assert torch.equal(weights[name], expected), name




@pytest.mark.unit
def test_transformers_loads_all_weights_and_generates_varied_output(tiny_model_dir, tokenizer):
    """Contract: AutoModelForCausalLM loads every tensor (none missing or unexpected) and its greedy output
    depends on the prompt and is not one repeated token."""
    model, info = AutoModelForCausalLM.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.float32
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    outputs = []
    for prompt in ("What is 12 + 7?", "Natalia sold 48 clips.", "def f(x):", '{"name": "calc"}'):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)  # (1, T + 16)
        outputs.append(tuple(out[0, enc["input_ids"].shape[1]:].tolist()))
    assert len(set(outputs)) == len(outputs), outputs
    assert all(len(set(o)) > 1 for o in outputs), outputs


@pytest.mark.unit
def test_shape_arguments_and_tied_embeddings(tmp_path):
    """Contract: layer/width/head arguments reach the HF model; tied checkpoints store no lm_head and load tied."""
    path = write_tiny_checkpoint(tmp_path, layers=3, hidden=48, heads=6, kv_heads=3, intermediate=96,
                                 rope_theta=500000.0, tie_word_embeddings=True, seed=1)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size) == (3, 48, 6, 3, 96)
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    logits = model(torch.tensor([[1, 2, 3]])).logits  # (1, 3, V)
    assert logits.shape == (1, 3, cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.unit
def test_qwen3_checkpoint_has_qk_norms_no_bias_and_its_own_head_dim(tmp_path):
    """Contract: `arch="qwen3"` writes a Qwen3ForCausalLM that transformers loads whole: q/k RMSNorm weights of
    head_dim, no QKV bias, head_dim 2 * hidden/heads by default (as Qwen3-0.6B) or as given; same tokenizer."""
    path = write_tiny_checkpoint(tmp_path / "q3", arch="qwen3", seed=2)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and not cfg.attention_bias
    assert cfg.head_dim == 2 * cfg.hidden_size // cfg.num_attention_heads == 32
    state = load_file(path / "model.safetensors")
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert state["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert not any(name.endswith("bias") for name in state)
    assert not torch.equal(state["model.layers.0.self_attn.k_norm.weight"], torch.ones(32))
    logits = model(torch.tensor([[1, 2, 3]])).logits  # (1, 3, V)
    assert torch.isfinite(logits).all()
    explicit = write_tiny_checkpoint(tmp_path / "q3h8", arch="qwen3", head_dim=8)
    assert json.loads((explicit / "config.json").read_text())["head_dim"] == 8
    with pytest.raises(ValueError, match="--arch"):
        write_tiny_checkpoint(tmp_path / "bad", arch="mistral")


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, flag",
    [({"heads": 3}, "--heads"), ({"kv_heads": 3}, "--kv-heads"), ({"hidden": 12, "heads": 4}, "--hidden"),
     ({"layers": 0}, "--layers")],
)
def test_inconsistent_shape_is_refused_naming_the_flag(tmp_path, kwargs, flag):
    """Contract: an impossible shape fails before anything is written, and the error names the flag to change."""
    with pytest.raises(ValueError, match=flag):
        write_tiny_checkpoint(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.unit
def test_special_and_tool_tokens_are_single_ids(tokenizer):
    """Contract: control and tool tags are one id each, also inside text; skip_special_tokens drops the control
    tokens but keeps the tool tags (SGLang's tool-call parser reads them from the detokenized text)."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + TOOL_TOKENS]
    assert len(set(ids)) == len(ids) and all(0 <= i < len(tokenizer) for i in ids)
    for token, token_id in zip(SPECIAL_TOKENS + TOOL_TOKENS, ids):
        assert tokenizer.encode(token) == [token_id]
        assert token_id in tokenizer.encode(f"x{token}y")
    text = '<|im_start|>assistant\nok<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>'
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == (
        'assistant\nok<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )


@pytest.mark.unit
def test_vocabulary_covers_digits_words_and_json(tokenizer):
    """Contract: the trained vocabulary is not just bytes: digits are single tokens and GSM8K-style English, JSON
    and code encode in well under one token per character."""
    for digit in "0123456789":
        assert len(tokenizer.encode(digit)) == 1
    samples = [
        "Janet has 16 eggs per day. She eats three for breakfast and sells the rest for $2 each. How much "
        "money does she make every day?",
        '{"name": "calc_gsm8k_reward", "arguments": {"answer": "18"}}',
        "def total(items):\n    return sum(items)\n",
    ]
    for text in samples:
        assert len(tokenizer.encode(text)) < 0.6 * len(text), text


@pytest.mark.unit
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.text(), st.sampled_from(SPECIAL_TOKENS + TOOL_TOKENS)), max_size=6))
def test_any_text_round_trips(tiny_model_dir, tokenizer, parts):
    """Contract: byte-level coverage: decode(encode(s)) == NFC(s) for any unicode (== s for NFC text, the same
    normalization as Qwen2's), tags included, and AutoTokenizer agrees with the raw tokenizer.json."""
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "".join(parts)
    expected = "".join(p if p in SPECIAL_TOKENS + TOOL_TOKENS else unicodedata.normalize("NFC", p) for p in parts)
    ids = tokenizer.encode(text)
    assert ids == raw.encode(text).ids
    assert tokenizer.decode(ids) == expected


# ----------------------------------------------------------------------------- chat template

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "calc_gsm8k_reward", "arguments": {"answer": "5"}}}]},
    {"role": "tool", "content": "Correct."},
    {"role": "tool", "content": "reward=1.0"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And 2*3?"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [{"name": "calc_gsm8k_reward", "arguments": '{"answer": "6"}'},
                    {"name": "calc_gsm8k_reward", "arguments": {"answer": "six"}}]},
    {"role": "tool", "content": "Correct."},
    {"role": "assistant", "content": "6"},
]


@pytest.mark.unit
def test_template_renders_plain_chat_in_chatml(tokenizer):
    """Contract: system/user/assistant turns render as <|im_start|>{role}\\n{content}<|im_end|>\\n, no default system
    prompt, and add_generation_prompt appends the assistant header."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>user\nV<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages[1:2]) == "<|im_start|>user\nU<|im_end|>\n"


@pytest.mark.unit
def test_template_renders_tools_calls_and_grouped_responses_in_hermes_form(tokenizer):
    """Contract: Qwen2.5/hermes layout: tools listed as JSON in <tools></tools> in the system block, each assistant
    call as <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call> (dict or JSON-string arguments, flat or
    OpenAI-nested calls), consecutive tool messages grouped in one user block of <tool_response>s."""
    assert render(tokenizer, CONVERSATION[:8], tools=TOOLS) == TOOLS_BLOCK + (
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"calc_gsm8k_reward\", \"arguments\": {\"answer\": \"5\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nCorrect.\n</tool_response>\n<tool_response>\nreward=1.0\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 5.<|im_end|>\n"
        "<|im_start|>user\nAnd 2*3?<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.\n<tool_call>\n{\"name\": \"calc_gsm8k_reward\", \"arguments\": "
        "{\"answer\": \"6\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"calc_gsm8k_reward\", \"arguments\": "
        "{\"answer\": \"six\"}}\n</tool_call><|im_end|>\n"
    )
    no_system = render(tokenizer, CONVERSATION[1:2], tools=TOOLS)
    assert no_system.startswith("<|im_start|>system\n# Tools\n\n")
    assert no_system.endswith("</tool_call><|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n")


def _assistant_text(message: dict) -> str:
    """What a model emits for an assistant message: content, then hermes calls as a model writes the JSON."""
    parts = [message["content"]] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        call = call.get("function", call)
        args = call["arguments"] if isinstance(call["arguments"], dict) else json.loads(call["arguments"])
        body = json.dumps({"name": call["name"], "arguments": args}, ensure_ascii=False)
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(parts)


def _assert_prefix_stable(tokenizer, messages, tools) -> int:
    checked = 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:k], tools=tools, add_generation_prompt=True)
        full = render(tokenizer, messages[: k + 1], tools=tools)
        assert prompt + _assistant_text(message) + "<|im_end|>\n" == full
        checked += 1
    return checked


@pytest.mark.unit
def test_template_is_prefix_stable_across_turns_in_text_and_ids(tokenizer):
    """Contract (rollout): rendering messages[:k] with the generation prompt, then appending the assistant's text and
    <|im_end|>\\n, equals rendering messages[:k+1]; and the prompt's token ids are a prefix of the longer render's."""
    for tools in (None, TOOLS):
        assert _assert_prefix_stable(tokenizer, CONVERSATION, tools) == 4
        for k in (2, 5, 7, 9):
            prompt_ids = tokenizer.encode(render(tokenizer, CONVERSATION[:k], tools=tools, add_generation_prompt=True))
            full_ids = tokenizer.encode(render(tokenizer, CONVERSATION[: k + 1], tools=tools))
            assert full_ids[: len(prompt_ids)] == prompt_ids


_text = st.text(max_size=20)
_call = st.fixed_dictionaries({
    "name": st.sampled_from(["calc_gsm8k_reward", "python", "search"]),
    "arguments": st.dictionaries(st.sampled_from(["answer", "code", "q"]), st.one_of(_text, st.integers()),
                                 max_size=2),
})
_assistant = st.builds(lambda content, calls: {"role": "assistant", "content": content, "tool_calls": calls},
                       _text, st.lists(_call, max_size=2))
_followup = st.one_of(
    st.lists(st.builds(lambda c: {"role": "tool", "content": c}, _text), min_size=1, max_size=3),
    st.builds(lambda c: [{"role": "user", "content": c}], _text),
)


@pytest.mark.unit
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.one_of(st.none(), _text), first=_text,
       turns=st.lists(st.tuples(_assistant, _followup), min_size=1, max_size=4), with_tools=st.booleans())
def test_template_prefix_stability_fuzz(tokenizer, system, first, turns, with_tools):
    """Contract (rollout): prefix stability holds for any mix of text turns, tool calls and tool responses."""
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": first})
    for assistant, followup in turns:
        messages.append(assistant)
        messages.extend(followup)
    assert _assert_prefix_stable(tokenizer, messages, TOOLS if with_tools else None) == len(turns)


@pytest.mark.integration
def test_sglang_parser_reads_the_rendered_tool_calls(tokenizer):
    """Contract: SGLang's own qwen25 FunctionCallParser recovers the names and arguments the template wrote."""
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    full = render(tokenizer, CONVERSATION[:8], tools=TOOLS)
    turn = full[full.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"): -len("<|im_end|>\n")]
    tools = [Tool(type="function", function=Function(**t["function"])) for t in TOOLS]
    normal, calls = FunctionCallParser(tools, "qwen25").parse_non_stream(turn)
    assert normal.strip() == "Let me check."
    assert [(c.name, json.loads(c.parameters)) for c in calls] == [
        ("calc_gsm8k_reward", {"answer": "6"}), ("calc_gsm8k_reward", {"answer": "six"})
    ]


# ----------------------------------------------------------------------------- CLI


@pytest.mark.unit
def test_cli_writes_the_requested_checkpoint_identically_in_a_fresh_process(tmp_path):
    """Contract: `python -m recipe.tiny_model --out DIR ...` writes the checkpoint with the given shape, byte-identical
    to the in-process writer (a fresh interpreter, other hash seed: tokenizer training and init are deterministic)."""
    out = tmp_path / "cli"
    subprocess.run(
        [sys.executable, "-m", "recipe.tiny_model", "--out", str(out), "--layers", "1", "--hidden", "32",
         "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--seed", "3", "--tie-word-embeddings"],
        check=True, cwd=REPO_ROOT, timeout=120, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["tie_word_embeddings"]) == (
        1, 32, 2, 1, 64, True)
    here = write_tiny_checkpoint(tmp_path / "py", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                                 seed=3, tie_word_embeddings=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in here.iterdir())
    for path in here.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, flag", [(["--heads", "5"], "--heads"), (["--heads", "4", "--kv-heads", "3"], "--kv-heads")]
)
def test_cli_bad_arguments_exit_with_a_usage_error_naming_the_flag(tmp_path, capsys, argv, flag):
    """Contract: a bad flag combination exits with argparse's usage error (code 2) naming the flag, writing nothing."""
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "bad"), *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
