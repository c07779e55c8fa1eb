"""`python -m recipe.show_trajectory DUMP [--uid U]`: print one dumped trajectory, coloured by segment.

DUMP is a `<step>.jsonl` file of `trainer.rollout_data_dir` / `validation_data_dir` (written by
`recipe.validation.trajectory_records`), or such a directory (its last step is read). The
trajectory's token ids are decoded with the model's tokenizer (the path recorded in the dump, or
`--tokenizer`), segment by segment: the prompt, then each turn span of the response, coloured by
what put it there: sampled by the policy (mask 1: the tokens the loss sees), tool output, simulated
user, chat-template glue. Masked-out tokens are printed like the rest, in their own colour, and
every segment is labelled (role, weight version, token range, mask), so the plain output (not a
terminal, `--no-color`, or `NO_COLOR` set) says the same. `--tokens` adds one line per response
token: index, id, mask, engine log-prob, weight version and the token's text.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from recipe.tracking import step_files

# ANSI colour of each segment kind; "assistant" spans are the sampled tokens.
COLORS = {"prompt": "2", "assistant": "32", "tool": "33", "user": "36", "template": "90"}
LABELS = {"prompt": "prompt", "assistant": "sampled", "tool": "tool", "user": "user", "template": "template"}


def load_records(dump: str | Path) -> list[dict[str, Any]]:
    """The records of a `<step>.jsonl` dump file, or of the last step's file in a dump directory."""
    path = Path(dump)
    if path.is_dir():
        files = step_files(path)
        if not files:
            raise SystemExit(f"{path} holds no <step>.jsonl dump; give trainer.rollout_data_dir or one of its files")
        path = files[max(files)]
    if not path.is_file():
        raise SystemExit(f"{path} does not exist; give a trainer.rollout_data_dir (or validation_data_dir) "
                         "<step>.jsonl file or directory")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if records and "response_ids" not in records[0]:
        raise SystemExit(f"{path} has no token ids (written before dumps held them); rerun with "
                         "trainer.rollout_data_dir set")
    return records


def pick(records: list[dict[str, Any]], uid: str | None) -> dict[str, Any]:
    """The record with `uid` (None: the first one)."""
    if not records:
        raise SystemExit("the dump holds no trajectory")
    if uid is None:
        return records[0]
    for r in records:
        if r["uid"] == uid:
            return r
    raise SystemExit(f"no trajectory with --uid {uid}; the dump holds {', '.join(r['uid'] for r in records)}")


def _paint(text: str, kind: str, color: bool) -> str:
    return f"\x1b[{COLORS[kind]}m{text}\x1b[0m" if color else text


def render(record: dict[str, Any], tokenizer: Any, *, color: bool, tokens: bool = False) -> str:
    """The trajectory as text: a header, then each segment labelled and decoded (coloured when `color`)."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    ids, mask, logprobs = record["response_ids"], record["response_mask"], record["rollout_logprobs"]
    rewards = record.get("rewards", {})
    lines = [
        (f"uid {record['uid']}  step {record['step']}  data_source {record.get('data_source')}  "
         f"finish {record.get('finish_reason')}  reward {rewards.get('total')}  "
         f"weight versions {record.get('weight_versions')}"),
        f"prompt {len(record['prompt_ids'])} tokens, response {len(ids)} tokens, {sum(mask)} sampled (mask 1)",
        "segments: " + " ".join(_paint(LABELS[k], k, color) for k in COLORS),
        _paint(f"--- prompt [{len(record['prompt_ids'])} tokens, mask 0]", "prompt", color),
        _paint(decode(record["prompt_ids"]), "prompt", color),
    ]
    for span in record["turns"]:
        kind = span["role"] if span["role"] in COLORS else "template"
        version = f" v{span['weight_version']}" if span["weight_version"] is not None else ""
        lines.append(_paint(f"--- {LABELS[kind]}{version} [{span['start']}:{span['end']}, "
                            f"mask {1 if kind == 'assistant' else 0}]", kind, color))
        lines.append(_paint(decode(ids[span["start"]:span["end"]]), kind, color))
    if tokens:
        lines.append("--- tokens: index id mask log-prob version text")
        for span in record["turns"]:
            kind = span["role"] if span["role"] in COLORS else "template"
            for i in range(span["start"], span["end"]):
                lines.append(_paint(f"{i:5d} {ids[i]:7d} {mask[i]} {logprobs[i]:9.4f} "
                                    f"{span['weight_version'] if span['weight_version'] is not None else '-':>3} "
                                    f"{json.dumps(decode([ids[i]]))}", kind, color))
    return "\n".join(lines)


def load_tokenizer(path: str | None, dump: str) -> Any:
    """The tokenizer at `path` (the dump's record or --tokenizer); exits with a message naming --tokenizer."""
    from transformers import AutoTokenizer

    if not path:
        raise SystemExit(f"{dump} records no tokenizer; pass --tokenizer <model dir or hub id>")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot load the tokenizer {path!r} ({e.__class__.__name__}); pass --tokenizer "
                         "<model dir or hub id>") from None


def main(argv: list[str] | None = None) -> None:
    """The command line; prints one trajectory to stdout."""
    parser = argparse.ArgumentParser(prog="python -m recipe.show_trajectory", description=__doc__.split("\n")[0])
    parser.add_argument("dump", help="a <step>.jsonl of trainer.rollout_data_dir / validation_data_dir, or the dir")
    parser.add_argument("--uid", help="the trajectory to show (default: the first one in the file)")
    parser.add_argument("--tokenizer", help="model dir or hub id to decode with (default: the one in the dump)")
    parser.add_argument("--tokens", action="store_true", help="also one line per response token")
    parser.add_argument("--no-color", action="store_true", help="plain text (also when stdout is not a terminal)")
    args = parser.parse_args(argv)
    record = pick(load_records(args.dump), args.uid)
    tokenizer = load_tokenizer(args.tokenizer or record.get("tokenizer"), args.dump)
    color = sys.stdout.isatty() and not args.no_color and "NO_COLOR" not in os.environ
    sys.stdout.write(render(record, tokenizer, color=color, tokens=args.tokens) + "\n")


if __name__ == "__main__":
    main()
