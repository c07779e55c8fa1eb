"""GSM8K preprocessing: raw `{question, answer}` records -> parquet rows in verl's RL format.

Reads the two splits from a local directory of `train.jsonl` / `test.jsonl` (GSM8K's own
format, as published in `openai/gsm8k`), or from the hub with `huggingface_hub` on machines
that can reach it, and writes `train.parquet` / `test.parquet`. One row per problem:

    data_source   "openai/gsm8k"
    prompt        [system message, user message]   (chat messages)
    ability       "math"
    reward_model  {style: "rule", ground_truth: "<final number>"}
    extra_info    {split, index, question, answer,
                   tools_kwargs {calc_gsm8k_reward: {create_kwargs: {ground_truth}}},
                   interaction_kwargs {name, query, ground_truth, solution}}

so one file serves the single-turn scorer, the `calc_gsm8k_reward` tool and both GSM8K
interactions (`gsm8k` reads `ground_truth`, `gsm8k_tutor` also reads `solution`).

Where it departs from verl's `gsm8k_multiturn_w_tool.py`: the ground truth goes through the
same extraction the scorer uses (`recipe.reward.gsm8k.extract_solution`), so "1,000" is stored
as "1000"; a record whose answer has no `#### N` line is refused, naming the record.

CLI: `python -m recipe.data.gsm8k --out DIR [--local-dir DIR_WITH_JSONL]`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from recipe.reward.gsm8k import extract_solution

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
HUB_CONFIG = "main"
SPLITS = ("train", "test")
TOOL_NAME = "calc_gsm8k_reward"
DEFAULT_INTERACTION = "gsm8k"

SYSTEM_PROMPT = (
    "You are a careful math tutor. Work through the problem step by step. When you have a result, "
    f"check it with the `{TOOL_NAME}` tool, correct yourself if the tool says it is wrong, and end "
    "your reply with the final number written as `#### <answer>`."
)
USER_SUFFIX = "Solve it step by step and write the final answer after `####`."


def ground_truth_of(answer: str, where: str) -> str:
    """The final number of a GSM8K reference solution (`#### N` line), normalized; raises if absent."""
    truth = extract_solution(answer, "strict")
    if truth is None:
        raise ValueError(f"{where}: the answer has no '#### <number>' line; is this GSM8K's `answer` field?")
    return truth


def make_row(record: dict[str, Any], split: str, index: int, interaction: str = DEFAULT_INTERACTION) -> dict[str, Any]:
    """One verl-format row from a GSM8K `{question, answer}` record."""
    where = f"gsm8k {split}[{index}]"
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"{where}: field {key!r} is missing or not text; GSM8K records have 'question' and 'answer'")
    question, answer = record["question"].strip(), record["answer"]
    truth = ground_truth_of(answer, where)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{question} {USER_SUFFIX}"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "answer": answer,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": truth}}},
            "interaction_kwargs": {"name": interaction, "query": question, "ground_truth": truth, "solution": answer},
        },
    }


def read_local_split(local_dir: str | Path, split: str) -> Iterator[dict[str, Any]]:
    """Records of `<local_dir>/<split>.jsonl`."""
    path = Path(local_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; --local-dir must hold GSM8K's train.jsonl and test.jsonl")
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_no}: not JSON ({err})") from err


def read_hub_split(split: str) -> Iterator[dict[str, Any]]:
    """Records of the hub copy `openai/gsm8k` (config `main`), via huggingface_hub + pyarrow."""
    import pyarrow.parquet as pq
    from huggingface_hub import HfApi, hf_hub_download

    files = [f for f in HfApi().list_repo_files(DATA_SOURCE, repo_type="dataset")
             if f.startswith(f"{HUB_CONFIG}/{split}-") and f.endswith(".parquet")]
    if not files:
        raise FileNotFoundError(f"no {HUB_CONFIG}/{split}-*.parquet in the hub dataset {DATA_SOURCE}")
    for name in sorted(files):
        yield from pq.read_table(hf_hub_download(DATA_SOURCE, name, repo_type="dataset")).to_pylist()


def write_rows(rows: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write rows to a parquet file; returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return len(rows)


def preprocess(out_dir: str | Path, local_dir: str | Path | None = None, limit: int | None = None,
               interaction: str = DEFAULT_INTERACTION) -> dict[str, Path]:
    """Write `<out_dir>/{train,test}.parquet` from `local_dir` (jsonl) or the hub; returns the paths.

    `limit` keeps the first N records of each split (for quick runs).
    """
    out = Path(out_dir)
    paths = {}
    for split in SPLITS:
        records = read_local_split(local_dir, split) if local_dir is not None else read_hub_split(split)
        rows = (make_row(r, split, i, interaction) for i, r in enumerate(itertools.islice(records, limit)))
        paths[split] = out / f"{split}.parquet"
        n = write_rows(rows, paths[split])
        logger.info("gsm8k %s: %d rows -> %s", split, n, paths[split])
    return paths


def main(argv: list[str] | None = None) -> None:
    """CLI entry: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m recipe.data.gsm8k", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="where train/test.parquet are written")
    parser.add_argument("--local-dir", type=Path, metavar="DIR", help="dir with GSM8K train.jsonl / test.jsonl; "
                        "default: download openai/gsm8k from the hub")
    parser.add_argument("--limit", type=int, metavar="N", help="keep the first N problems of each split")
    parser.add_argument("--interaction", default=DEFAULT_INTERACTION, help="interaction_kwargs.name of every row")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    preprocess(args.out, args.local_dir, args.limit, args.interaction)


if __name__ == "__main__":
    main()
