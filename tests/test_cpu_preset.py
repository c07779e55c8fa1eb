"""The CPU preset that learns: its data, its model options, its result line and plot, and its wiring end to end.

Contracts: the synthetic problems are GSM8K records the GSM8K code paths accept (RLDataset with the
preset's tool, the gsm8k scorer, verl's multi-turn SFT layout the template renders and the tool
parser reads back); the training-grade init and the compact tools block are options that leave the
tiny model's defaults alone; `recipe.cpu_preset` turns validation JSONL into the preset's JSON line
and an SVG.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TOOL_CONFIG = ROOT / "tool_configs" / "python_calc_tool_config.yaml"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from recipe.tasks.synthetic_math import generate

    out = tmp_path_factory.mktemp("synthetic")
    generate(out, seed=3, n_train=300, n_test=50, n_sft=200, tool_fraction=0.3, tool_config=TOOL_CONFIG)
    return out


def _rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(str(path)).to_pylist()


@pytest.mark.unit
def test_problems_are_gsm8k_records_with_right_answers_and_unseen_held_out(data_dir):
    """Contract: every row's ground truth is the `#### N` of its GSM8K-format answer and equals the arithmetic in
    it; held-out questions occur in neither the RL train rows nor the SFT demos."""
    train, test = _rows(data_dir / "train.parquet"), _rows(data_dir / "test.parquet")
    assert (len(train), len(test)) == (300, 50)
    for row in train + test:
        answer = row["extra_info"]["answer"]
        a, op, b = re.search(r"(\d+) ([-+*]) (\d+) =", answer).groups()
        assert row["reward_model"]["ground_truth"] == answer.rsplit("#### ", 1)[1] == str(eval(f"{a}{op}{b}"))
        assert int(a) < 100 and int(b) < 100 and row["data_source"] == "gsm8k"
    sft_questions = {r["messages"][1]["content"] for r in _rows(data_dir / "sft.parquet")}
    held_out = {r["extra_info"]["question"] for r in test}
    assert not held_out & ({r["extra_info"]["question"] for r in train} | sft_questions)


@pytest.mark.unit
def test_same_seed_same_files_other_seed_other_problems(data_dir, tmp_path):
    """Contract: SEED decides the data (byte-identical parquet for the same seed)."""
    from recipe.tasks.synthetic_math import generate

    generate(tmp_path / "a", seed=3, n_train=300, n_test=50, n_sft=200, tool_config=TOOL_CONFIG)
    generate(tmp_path / "b", seed=4, n_train=300, n_test=50, n_sft=200, tool_config=TOOL_CONFIG)
    for name in ("train.parquet", "test.parquet", "sft.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (data_dir / name).read_bytes()
    assert _rows(tmp_path / "b" / "test.parquet") != _rows(data_dir / "test.parquet")


@pytest.mark.unit
def test_rows_load_through_the_rl_dataset_and_score_with_the_gsm8k_scorer(data_dir):
    """Contract: the RL rows pass RLDataset's validation with the preset's tool config; the gsm8k scorer gives 1 to
    the reference answer's last line and 0 to a wrong one."""
    from recipe.data.dataset import RLDataset
    from recipe.reward.scoring import task_compute_score
    from rollout.interactions.registry import InteractionRegistry
    from rollout.tools.registry import ToolRegistry

    tools = ToolRegistry.from_config(str(TOOL_CONFIG))
    data = RLDataset([data_dir / "test.parquet"], tools, InteractionRegistry.from_config(None))
    assert len(data) == 50 and tools.select(data.items[0].tools_kwargs) == ["python"]
    source, truth = data.items[0].data_source, data.items[0].ground_truth
    score = task_compute_score()
    assert score(source, f"#### {truth}", truth) == 1.0 and score(source, f"#### {int(truth) + 1}", truth) == 0.0


@pytest.mark.unit
def test_sft_demos_render_and_their_tool_calls_parse_back(data_dir, tmp_path):
    """Contract: the SFT rows are verl multi-turn SFT (messages + tools JSON); about tool_fraction of them call the
    tool; the compact template (one signature line per tool) renders them prefix-stably, and the rollout's parser
    reads the rendered call back as a `python` call whose code prints the answer's arithmetic; the tool message is
    the tool's output for it."""
    from transformers import AutoTokenizer

    from recipe.tiny_model import write_tiny_checkpoint
    from rollout.tool_parser import ToolCallParser
    from rollout.tools.registry import ToolRegistry

    model = write_tiny_checkpoint(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32,
                                  compact_tools=True)
    tok = AutoTokenizer.from_pretrained(model)
    rows = _rows(data_dir / "sft.parquet")
    with_tool = [r for r in rows if any(m.get("tool_calls") for m in r["messages"])]
    assert 0.15 < len(with_tool) / len(rows) < 0.45
    tools = json.loads(with_tool[0]["tools"])
    registry = ToolRegistry.from_config(str(TOOL_CONFIG))
    assert tools == registry.schemas()
    parser = ToolCallParser([registry.runner("python").tool.get_openai_tool_schema()], "qwen25")
    for row in with_tool[:10]:
        msgs = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        prompt = tok.apply_chat_template(msgs[:2], tools=tools, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(msgs[:3], tools=tools, tokenize=False)
        assert "# Tools" not in prompt and "python(code): " in prompt and full.startswith(prompt)
        call_text = full[len(prompt):-len("<|im_end|>\n")]
        parsed = parser.parse(call_text)
        assert [c.name for c in parsed.calls] == ["python"]
        code = parsed.calls[0].arguments["code"]
        assert msgs[2]["content"] == f"{code[len('print('):-1]} = ?"  # the same equation as a demo without the tool
        assert str(eval(code[len("print("):-1])) + "\n" in msgs[3]["content"]
        assert msgs[4]["content"] == f"#### {eval(code[len('print('):-1])}"


@pytest.mark.unit
def test_training_init_and_compact_tools_are_options_defaults_unchanged(tmp_path):
    """Contract: init_std scales the random init (and config.json's initializer_range); compact_tools changes only
    the chat template; the defaults stay the parity tests' (std 0.2, full Qwen2.5 tools block)."""
    from recipe.tiny_model import INIT_STD, write_tiny_checkpoint
    from recipe.tiny_tokenizer import CHAT_TEMPLATE, COMPACT_CHAT_TEMPLATE

    shape = dict(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=64)
    default = write_tiny_checkpoint(tmp_path / "d", **shape)
    trained = write_tiny_checkpoint(tmp_path / "t", **shape, init_std=0.02, compact_tools=True)
    for d, std, template in ((default, INIT_STD, CHAT_TEMPLATE), (trained, 0.02, COMPACT_CHAT_TEMPLATE)):
        w = load_file(str(d / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
        assert abs(float(w.std()) - std) < 0.1 * std
        assert json.loads((d / "config.json").read_text())["initializer_range"] == std
        assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == template
    assert (default / "tokenizer.json").read_bytes() == (trained / "tokenizer.json").read_bytes()


def _records(step: int, outcomes: list[float], called: list[bool]) -> str:
    return "".join(json.dumps({"step": step, "rewards": {"outcome": o}, "tool_calls": [{"name": "python"}] if c else []})
                   + "\n" for o, c in zip(outcomes, called))


@pytest.mark.unit
def test_result_line_and_plot_from_validation_jsonl(tmp_path):
    """Contract: a, c come from the validation before step 1 (the SFT policy), b, d from the last one; the SVG has
    one point per validation and curve; a run without the pre-training validation is refused."""
    from recipe.cpu_preset import read_validations, summary, svg_plot

    (tmp_path / "0.jsonl").write_text(_records(0, [1.0, 0.0, 0.0, 0.0], [True, False, False, True]))
    (tmp_path / "5.jsonl").write_text(_records(5, [1.0, 1.0, 0.0, 1.0], [True, True, True, True]))
    per_step = read_validations(tmp_path)
    assert per_step[0]["acc_with_tool"] == 0.5 and per_step[0]["acc_without_tool"] == 0.0
    assert summary(per_step, 12.34) == {"val_acc_sft": 0.25, "val_acc_rl": 0.75, "tool_call_rate_sft": 0.5,
                                        "tool_call_rate_rl": 1.0, "steps": 5, "wall_s": 12.3}
    svg = svg_plot(per_step)
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and svg.count("<circle") == 4
    with pytest.raises(ValueError, match="val_before_train"):
        summary({5: per_step[5]}, 0.0)
