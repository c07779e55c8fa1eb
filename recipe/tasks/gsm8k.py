"""GSM8K, the whole task: its data sources, raw records -> verl RL rows, and the answer scorer.

Rows (`preprocess`, from a local directory of GSM8K's `train.jsonl` / `test.jsonl`, as published
in `openai/gsm8k`, or from the hub with `huggingface_hub`), one per problem:

    data_source   "openai/gsm8k"
    prompt        [system message, user message]   (chat messages)
    ability       "math"
    reward_model  {style: "rule", ground_truth: "<final number>"}
    extra_info    {split, index, question, answer,
                   tools_kwargs {calc_gsm8k_reward: {create_kwargs: {ground_truth}}},
                   interaction_kwargs {name, query, ground_truth, solution}}

so one file serves the outcome reward, the `calc_gsm8k_reward` tool and both GSM8K
interactions (`gsm8k` reads `ground_truth`, `gsm8k_tutor` also reads `solution`).

Scoring (`compute_score`, the one GSM8K scorer: the outcome reward finds it by `DATA_SOURCES`, the
tool and interaction YAML name it by dotted path, `config.score_fn`) is verl's: the solution is cut
to its last 300 characters, `strict` takes the number after the last `####` and scores 0 when there
is none (a format miss); `flexible` (opt-in) takes the last number anywhere. A found answer scores
`score` when it equals the ground truth, else `format_score`.

Where it departs from verl: numbers are compared by value after dropping `$`, `,` and a trailing
`.` ("1,000" == "1000" == "1000.00"; verl compares the strings), and `#### 72` and `####72` both
count; a ground truth that is not a number is compared as text (a bad row scores 0, it never
stops the run). The ground truth of a row goes through the scorer's own extraction, so "1,000" is
stored as "1000"; a record whose answer has no `#### N` line is refused, naming the record.

CLI: `python -m recipe.tasks.gsm8k --out DIR [--local-dir DIR_WITH_JSONL]`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import re
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from recipe.tasks import write_rows

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
DATA_SOURCES = (DATA_SOURCE, "gsm8k")
"""The `data_source` values this task scores (`gsm8k`: the CPU preset's synthetic GSM8K-format rows)."""
VERL_ALIASES = {"verl.utils.reward_score.gsm8k.compute_score": f"{__name__}.compute_score"}
"""verl's GSM8K scorer, which verl's gsm8k tool and interaction YAML use by default, is this one."""
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

METHODS = ("strict", "flexible")
CLIP_CHARS = 300  # only the end of a solution is searched, as in verl

_STRICT = re.compile(r"#### *(-?\$?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9.,]*|-?\.[0-9]+")


def normalize_number(text: str) -> str | None:
    """`"$1,000."` -> `"1000"`; None when the text is not a finite number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    normalized = format(value.normalize(), "f")
    return "0" if normalized in {"-0", "0"} else normalized


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer among the last CLIP_CHARS characters, normalized; None when there is none."""
    if method not in METHODS:
        raise ValueError(f"unknown gsm8k extraction method {method!r}; use one of {METHODS}")
    tail = solution_str[-CLIP_CHARS:]
    matches = (_STRICT if method == "strict" else _NUMBER).findall(tail)
    for candidate in reversed(matches):
        number = normalize_number(candidate)
        if number is not None:
            return number
    return None


def compute_score(solution_str: str, ground_truth: object, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """`score` if the answer equals `ground_truth`, `format_score` if an answer was found but differs, 0.0 if none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth).strip()
    return score if answer == (normalize_number(truth) or truth) else format_score



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
    parser = argparse.ArgumentParser(prog="python -m recipe.tasks.gsm8k", description=__doc__.split("\n")[0])
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
