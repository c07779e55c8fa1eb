"""The CPU preset's result: validation accuracy per step from a run's validation JSONL, as a JSON line and an SVG.

`run_gsm8k.sh` without a GPU runs synthetic data -> tiny model -> SFT (`recipe.main_sft`) -> GRPO
(`recipe.main_ppo --config-name cpu_learn`, validating before the first step, every
`trainer.test_freq` steps and after the last, into `trainer.validation_data_dir`), then this:

    python -m recipe.cpu_preset --val-dir RUN/validation --out RUN --wall-s SECONDS

reads `<val-dir>/<step>.jsonl` (one record per held-out sample, `recipe.validation.trajectory_records`),
prints one JSON line

    {"val_acc_sft": a, "val_acc_rl": b, "tool_call_rate_sft": c, "tool_call_rate_rl": d, "steps": n, "wall_s": t}

(a, c: the validation before the first RL step, i.e. the SFT policy; b, d: after the last step),
writes `<out>/val_acc.json` (those figures per validated step, plus the accuracy of samples with
and without a tool call) and `<out>/val_acc.svg` (accuracy and tool-call rate per step). A sample
is correct when its outcome score (the GSM8K scorer, `rewards.outcome`) is 1.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def step_figures(records: list[dict[str, Any]]) -> dict[str, float]:
    """Accuracy, tool-call rate and the accuracy with / without a tool call of one validation's records."""
    n = len(records)
    correct = [r["rewards"]["outcome"] >= 1.0 for r in records]
    called = [bool(r["tool_calls"]) for r in records]
    with_tool = [c for c, t in zip(correct, called) if t]
    without = [c for c, t in zip(correct, called) if not t]
    return {
        "samples": n,
        "acc": sum(correct) / n,
        "tool_call_rate": sum(called) / n,
        "acc_with_tool": sum(with_tool) / len(with_tool) if with_tool else None,
        "acc_without_tool": sum(without) / len(without) if without else None,
    }


def read_validations(val_dir: str | Path) -> dict[int, dict[str, float]]:
    """`{step: step_figures}` for every `<step>.jsonl` in `val_dir`, by step."""
    out = {}
    for path in Path(val_dir).glob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if records:
            out[int(path.stem)] = step_figures(records)
    if not out:
        raise FileNotFoundError(f"no validation records in {val_dir}; run main_ppo with data.val_files and "
                                "trainer.validation_data_dir set to it")
    return dict(sorted(out.items()))


def summary(per_step: dict[int, dict[str, float]], wall_s: float) -> dict[str, float]:
    """The preset's final JSON line: first validation (the SFT policy) vs the last one (after RL)."""
    first, last = min(per_step), max(per_step)
    if first != 0:
        raise ValueError(f"the first validation is after step {first}; the SFT policy's figures need "
                         "trainer.val_before_train=true")
    return {"val_acc_sft": round(per_step[first]["acc"], 4), "val_acc_rl": round(per_step[last]["acc"], 4),
            "tool_call_rate_sft": round(per_step[first]["tool_call_rate"], 4),
            "tool_call_rate_rl": round(per_step[last]["tool_call_rate"], 4), "steps": last, "wall_s": round(wall_s, 1)}


def svg_plot(per_step: dict[int, dict[str, float]], title: str = "held-out validation") -> str:
    """A small line plot (SVG text): accuracy and tool-call rate (0..1) against the RL step."""
    w, h, left, right, top, bottom = 480, 300, 50, 20, 30, 40
    steps = list(per_step)
    span = max(steps[-1] - steps[0], 1)

    def xy(step: int, value: float) -> str:
        x = left + (step - steps[0]) / span * (w - left - right)
        y = top + (1.0 - value) * (h - top - bottom)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="18" text-anchor="middle">{title}</text>']
    for v in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = top + (1.0 - v) * (h - top - bottom)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{w - right}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for s in steps:
        x = xy(s, 0.0).split(",")[0]
        parts.append(f'<text x="{x}" y="{h - bottom + 16}" text-anchor="middle">{s}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 6}" text-anchor="middle">RL step (0: after SFT)</text>')
    for key, color, label in (("acc", "#1f77b4", "accuracy"), ("tool_call_rate", "#ff7f0e", "tool-call rate")):
        points = " ".join(xy(s, f[key]) for s, f in per_step.items())
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [f'<circle cx="{p.split(",")[0]}" cy="{p.split(",")[1]}" r="3" fill="{color}"/>' for p in points.split()]
        ly = top + 14 + (0 if key == "acc" else 16)
        parts.append(f'<text x="{left + 10}" y="{ly}" fill="{color}">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    """CLI: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m recipe.cpu_preset", description=__doc__.split("\n")[0])
    parser.add_argument("--val-dir", required=True, type=Path, help="trainer.validation_data_dir of the RL run")
    parser.add_argument("--out", required=True, type=Path, help="where val_acc.json and val_acc.svg are written")
    parser.add_argument("--wall-s", type=float, default=0.0, help="wall time of the whole preset, for the JSON line")
    args = parser.parse_args(argv)
    per_step = read_validations(args.val_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "val_acc.json").write_text(json.dumps(per_step, indent=2) + "\n", encoding="utf-8")
    (args.out / "val_acc.svg").write_text(svg_plot(per_step), encoding="utf-8")
    print(json.dumps(summary(per_step, args.wall_s)))  # the preset's result line (a CLI's output, not a log)


if __name__ == "__main__":
    main()
