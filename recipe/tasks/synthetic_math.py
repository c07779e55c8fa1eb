"""Synthetic GSM8K-format arithmetic: verl RL parquet for GRPO and verl multi-turn SFT demos.

The CPU preset's task (`run_gsm8k.sh` without a GPU). Each problem is a one-step word problem
with one- and two-digit operands, written as a GSM8K record (`question`, and an `answer` whose
last line is `#### N`), so it goes through the GSM8K code paths unchanged: the ground truth is
extracted by `recipe.tasks.gsm8k.ground_truth_of`, rows are read by `RLDataset`, and the outcome is
scored by the GSM8K task's scorer (strict `#### N`; its DATA_SOURCES include "gsm8k"). The policy may call the `python` tool
(`tool_configs/python_calc_tool_config.yaml`: the sandbox, a one-line schema) as a calculator.

Files written to `--out`:

    train.parquet, test.parquet   RL rows (data_source "gsm8k", prompt [system, user],
                                  reward_model.ground_truth, extra_info {split, index, question, answer});
                                  no tools_kwargs: every configured tool is offered
    sft.parquet                   verl multi-turn SFT rows: `messages` and `tools` (JSON text of the
                                  tool schemas, exactly as the rollout renders them)

An SFT demo writes the equation and either its result (`"23 + 45 = 68\\n#### 68"`) or, with
probability `--tool-fraction`, `"23 + 45 = ?"` and a tool call (`print(23 + 45)`), then reads the
tool's reply (the text the python tool returns for that output) and answers `#### 68`. Both kinds
copy the operands from the question the same way, so every demo trains that. A tiny model cannot
add two-digit numbers, but it can copy them: so the SFT policy is right mostly when it calls the
tool, and it calls it about as often as its demos did. That leaves GRPO something to find on the training
problems' rewards: call the tool every time. Held-out problems never occur in train or SFT data.

Departs from GSM8K: one arithmetic step per problem and a short system line (the tool block of
the chat template is the bulk of the prompt already).

CLI: `python -m recipe.tasks.synthetic_math --out DIR [--seed S --train N --test N --sft N --tool-fraction F]`.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recipe.tasks import write_rows
from recipe.tasks.gsm8k import ground_truth_of

logger = logging.getLogger(__name__)

DATA_SOURCE = "gsm8k"
"""Scored by the GSM8K task's scorer (recipe.tasks.gsm8k declares this source)."""
TOOL_CONFIG = "tool_configs/python_calc_tool_config.yaml"
TOOL_NAME = "python"
SYSTEM_PROMPT = "Solve it. You may compute with the python tool. End with #### <answer>."

_NAMES = ("Tom", "Ana", "Sam", "Mei", "Ken", "Lily", "Omar", "Priya", "John", "Maria", "Carlos", "Julie")
_ITEMS = ("apples", "books", "pencils", "marbles", "eggs", "stickers", "cards", "cookies", "shells", "coins")

# (op, question template, answer-line template); a and b are the operands, c the result
_TEMPLATES = (
    ("+", "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
     "{name} has {a} + {b} = <<{a}+{b}={c}>>{c} {item}."),
    ("+", "A box holds {a} {item}. {name} puts in {b} more. How many {item} are in the box?",
     "The box holds {a} + {b} = <<{a}+{b}={c}>>{c} {item}."),
    ("-", "{name} has {a} {item} and gives away {b}. How many {item} are left?",
     "{name} has {a} - {b} = <<{a}-{b}={c}>>{c} {item} left."),
    ("-", "There are {a} {item} on a shelf. {name} takes {b}. How many {item} stay on the shelf?",
     "{a} - {b} = <<{a}-{b}={c}>>{c} {item} stay."),
    ("*", "{name} buys {a} bags with {b} {item} in each. How many {item} does {name} buy?",
     "{name} buys {a} * {b} = <<{a}*{b}={c}>>{c} {item}."),
)


def make_record(rng: random.Random) -> dict[str, Any]:
    """One GSM8K-format record `{question, answer, op, a, b}`: operands of one or two digits.

    Sums and differences take operands in 1..99 (a >= b for differences); products a two-digit
    and a one-digit factor, so every result has at most three digits.
    """
    op, question, line = rng.choice(_TEMPLATES)
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(2, 99)
        if rng.random() < 0.5:
            a, b = b, a
    else:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if op == "-" and a < b:
            a, b = b, a
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    fields = {"name": rng.choice(_NAMES), "item": rng.choice(_ITEMS), "a": a, "b": b, "c": c}
    return {"question": question.format(**fields), "answer": f"{line.format(**fields)}\n#### {c}",
            "op": op, "a": a, "b": b}


def rl_row(record: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """A verl RL row (GSM8K's layout, see recipe.tasks.gsm8k) for one record."""
    truth = ground_truth_of(record["answer"], f"synthetic {split}[{index}]")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": record["question"]}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": record["question"], "answer": record["answer"]},
    }


def python_tool_reply(stdout: str) -> str:
    """The text the python tool returns for a run that printed `stdout` and exited 0."""
    from rollout.tools.sandbox import SandboxResult

    return SandboxResult(stdout=stdout, stderr="", exit_code=0, timed_out=False, truncated=False, duration_s=0.0,
                         isolation="namespaces").to_text()


def sft_row(record: dict[str, Any], use_tool: bool, tools_json: str) -> dict[str, Any]:
    """A verl multi-turn SFT row: the RL prompt, then the demo (with or without a tool call)."""
    a, b, op = record["a"], record["b"], record["op"]
    truth = ground_truth_of(record["answer"], "synthetic sft")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": record["question"]}]
    if use_tool:
        call = {"type": "function", "function": {"name": TOOL_NAME,
                                                 "arguments": json.dumps({"code": f"print({a} {op} {b})"})}}
        messages += [{"role": "assistant", "content": f"{a} {op} {b} = ?", "tool_calls": [call]},
                     {"role": "tool", "content": python_tool_reply(f"{truth}\n")},
                     {"role": "assistant", "content": f"#### {truth}"}]
    else:
        messages.append({"role": "assistant", "content": f"{a} {op} {b} = {truth}\n#### {truth}"})
    return {"messages": messages, "tools": tools_json}


def unique_records(rng: random.Random, n: int, exclude: set[str]) -> Iterator[dict[str, Any]]:
    """`n` records whose questions are new (not in `exclude`, which grows with every record returned)."""
    made = 0
    while made < n:
        record = make_record(rng)
        if record["question"] not in exclude:
            exclude.add(record["question"])
            made += 1
            yield record


def tool_schemas_json(tool_config: str | Path) -> str:
    """The tool schemas of `tool_config`, as the rollout renders them into the chat template, as JSON text."""
    from rollout.tools.registry import ToolRegistry

    return json.dumps(ToolRegistry.from_config(str(tool_config)).schemas())


def generate(out_dir: str | Path, *, seed: int = 0, n_train: int = 4000, n_test: int = 256, n_sft: int = 4000,
             tool_fraction: float = 0.3, tool_config: str | Path = TOOL_CONFIG) -> dict[str, Path]:
    """Write train / test RL parquet and the SFT parquet to `out_dir`; returns their paths. Same seed, same files."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"--tool-fraction must be in [0, 1], got {tool_fraction}")
    rng = random.Random(seed)
    out = Path(out_dir)
    seen: set[str] = set()
    test = list(unique_records(rng, n_test, seen))  # drawn first: nothing later repeats a held-out question
    train = list(unique_records(rng, n_train, seen))
    sft = list(unique_records(rng, n_sft, seen))
    tools_json = tool_schemas_json(tool_config)
    paths = {"train": out / "train.parquet", "test": out / "test.parquet", "sft": out / "sft.parquet"}
    write_rows((rl_row(r, "train", i) for i, r in enumerate(train)), paths["train"])
    write_rows((rl_row(r, "test", i) for i, r in enumerate(test)), paths["test"])
    write_rows((sft_row(r, rng.random() < tool_fraction, tools_json) for r in sft), paths["sft"])
    logger.info("synthetic math (seed %d): %d train, %d held-out, %d SFT demos (%.0f%% with a tool call) -> %s",
                seed, n_train, n_test, n_sft, 100 * tool_fraction, out)
    return paths


def main(argv: list[str] | None = None) -> None:
    """CLI entry: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m recipe.tasks.synthetic_math", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="where the parquet files are written")
    parser.add_argument("--seed", type=int, default=0, help="problem and demo seed")
    parser.add_argument("--train", type=int, default=4000, metavar="N", help="RL training problems")
    parser.add_argument("--test", type=int, default=256, metavar="N", help="held-out problems (validation)")
    parser.add_argument("--sft", type=int, default=4000, metavar="N", help="SFT demonstrations")
    parser.add_argument("--tool-fraction", type=float, default=0.3, metavar="F", help="share of demos that call the tool")
    parser.add_argument("--tool-config", default=TOOL_CONFIG, help="tool YAML whose schemas the SFT rows carry")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    generate(args.out, seed=args.seed, n_train=args.train, n_test=args.test, n_sft=args.sft,
             tool_fraction=args.tool_fraction, tool_config=args.tool_config)


if __name__ == "__main__":
    main()
