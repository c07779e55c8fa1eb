"""GSM8K preprocessing and the RL dataset's load-time validation (the scorer: tests/test_reward.py).

Rows are written by the tests themselves (a few GSM8K-format records), never read from the
real dataset, so the suite runs anywhere.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe.tasks import gsm8k
from recipe.data.dataset import RLDataset, read_parquet_rows
from rollout.interactions.registry import InteractionRegistry
from rollout.tools.registry import ToolRegistry

CONFIGS = Path(__file__).resolve().parents[1] / "tool_configs"
RECORDS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nTotal 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A shop sells 1200 pens a day. How many in 1 day?", "answer": "It sells 1,200.\n#### 1,200"},
    {"question": "Tom has $5.50 and spends $2. How much is left?", "answer": "5.50 - 2 = 3.5\n#### 3.50"},
]


def write_jsonl_dir(root: Path, records: list[dict]) -> Path:
    for split in gsm8k.SPLITS:
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture
def registries():
    return (ToolRegistry.from_config(str(CONFIGS / "gsm8k_tool_config.yaml")),
            InteractionRegistry.from_config(str(CONFIGS / "gsm8k_interaction_config.yaml")))


@pytest.mark.unit
def test_preprocess_writes_verl_rows_with_extracted_ground_truth(tmp_path):
    """Contract: every GSM8K record becomes one verl-format row whose ground truth (the `####` number,
    normalized) is the same in reward_model, the tool's create_kwargs and the interaction kwargs."""
    paths = gsm8k.preprocess(tmp_path / "out", write_jsonl_dir(tmp_path, RECORDS))
    rows = [row for _, row in read_parquet_rows([paths["train"]])]
    assert len(rows) == len(RECORDS)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "1200", "3.5"]
    for i, (row, record) in enumerate(zip(rows, RECORDS)):
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["reward_model"]["style"] == "rule"
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert record["question"] in row["prompt"][1]["content"]
        extra = row["extra_info"]
        assert extra["split"] == "train" and extra["index"] == i
        truth = row["reward_model"]["ground_truth"]
        assert extra["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
        assert extra["interaction_kwargs"]["name"] == "gsm8k"
        assert extra["interaction_kwargs"]["ground_truth"] == truth
        assert extra["interaction_kwargs"]["solution"] == record["answer"]


@pytest.mark.unit
def test_preprocess_limit_and_bad_records(tmp_path):
    """Contract: `limit` keeps the first N records; a record without a `####` answer is refused, naming it."""
    paths = gsm8k.preprocess(tmp_path / "out", write_jsonl_dir(tmp_path, RECORDS), limit=2)
    assert len(read_parquet_rows([paths["test"]])) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    write_jsonl_dir(bad, [RECORDS[0], {"question": "q", "answer": "no final line"}])
    with pytest.raises(ValueError, match=r"gsm8k train\[1\].*####"):
        gsm8k.preprocess(tmp_path / "out2", bad)
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        gsm8k.preprocess(tmp_path / "out3", tmp_path / "missing")


@pytest.mark.unit
def test_dataset_validates_rows_against_registries(tmp_path, registries):
    """Contract: rows naming an unknown tool or interaction are refused at load, naming the file row;
    well-formed rows become prompts with their tools / interaction kwargs and ground truth."""
    tools, interactions = registries
    rows = [gsm8k.make_row(r, "train", i) for i, r in enumerate(RECORDS)]
    good = tmp_path / "good.parquet"
    gsm8k.write_rows(rows, good)
    ds = RLDataset([good], tools, interactions)
    assert len(ds) == 3
    prompt = ds.items[0]
    assert prompt.data_source == "openai/gsm8k" and prompt.ground_truth == "72"
    assert prompt.tools_kwargs == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}

    wrong_tool = [dict(rows[0]), dict(rows[1])]
    wrong_tool[1] = {**rows[1], "extra_info": {**rows[1]["extra_info"], "tools_kwargs": {"calc_gsm8k": {"create_kwargs": {"ground_truth": "1200"}}}}}
    path = tmp_path / "wrong_tool.parquet"
    gsm8k.write_rows(wrong_tool, path)
    with pytest.raises(ValueError, match=r"wrong_tool.parquet\[1\].*calc_gsm8k"):
        RLDataset([path], tools, interactions)

    wrong_inter = [gsm8k.make_row(RECORDS[0], "train", 0, interaction="grader")]
    path = tmp_path / "wrong_inter.parquet"
    gsm8k.write_rows(wrong_inter, path)
    with pytest.raises(ValueError, match=r"wrong_inter.parquet\[0\].*grader"):
        RLDataset([path], tools, interactions)
    # Not configured at all: the kwargs are ignored, as in verl.
    ds = RLDataset([path], ToolRegistry([]), InteractionRegistry([]))
    assert ds.items[0].interaction_kwargs == {} and ds.items[0].tools_kwargs == {}


@pytest.mark.unit
def test_dataset_batches_are_seeded_and_group_ids_unique(tmp_path, registries):
    """Contract: batches hold `batch_size` prompts, the same seed gives the same order, every prompt
    uid is unique over epochs (it is the GRPO group id), and each uid maps to its data source."""
    tools, interactions = registries
    path = tmp_path / "d.parquet"
    gsm8k.write_rows([gsm8k.make_row(RECORDS[i % 3], "train", i) for i in range(6)], path)
    ds = RLDataset([path], tools, interactions)
    take = lambda seed: [b for _, b in zip(range(4), ds.batches(3, seed=seed))]  # noqa: E731 - 2 epochs
    a, b = take(0), take(0)
    assert [[p.uid for p in x.prompts] for x in a] == [[p.uid for p in x.prompts] for x in b]
    assert all(len(x.prompts) == 3 for x in a)
    assert [x.epoch for x in a] == [0, 0, 1, 1]
    uids = [p.uid for x in a for p in x.prompts]
    assert len(set(uids)) == len(uids) == 12
    assert all(p.data_source == "openai/gsm8k" for x in a for p in x.prompts)
    with pytest.raises(ValueError, match="train_batch_size=7"):
        next(ds.batches(7))
