"""The trajectory dump (recipe.validation.trajectory_records) and `python -m recipe.show_trajectory` on it.

A cpu_tiny-style dump is made in-process: the tiny model's tokenizer renders a gsm8k-like chat, and a
trajectory is built segment by segment as the agent loop builds one (two sampled turns under two weight
versions, a tool response, a simulated user turn, template glue), then dumped by the trainer's own code.
tests/test_trainer_e2e.py's run writes the real dump (cpu_tiny with trainer.rollout_data_dir)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe import show_trajectory
from recipe.reward import RewardTerms
from recipe.validation import trajectory_records, write_jsonl
from rollout.trajectory import FinishReason, Trajectory

ROOT = Path(__file__).resolve().parents[1]
SEGMENTS = [("assistant", "<tool_call>\nprint(3 * 4)\n</tool_call>", 1), ("tool", "12", None),
            ("template", "<|im_end|>\n", None), ("assistant", "#### 12", 2), ("user", "Correct, well done.", None)]


@pytest.fixture(scope="module")
def dump(tiny_model_dir, tmp_path_factory):
    """(dump file, the trajectories dumped, the tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 boxes of 4 apples. How many?"}],
                                     add_generation_prompt=True, tokenize=False)
    trajs = []
    for k in range(2):
        t = Trajectory(uid=f"p0/{k}", prompt_uid="p0", sample_index=k, prompt_ids=tok.encode(prompt),
                       data_source="openai/gsm8k", ground_truth="12")
        for role, text, version in SEGMENTS[: len(SEGMENTS) - k]:
            ids = tok.encode(text, add_special_tokens=False)
            if role == "assistant":
                t.append_assistant(ids, [-0.25 * (i + 1) for i in range(len(ids))], version)
            else:
                t.append_context(ids, role)
        t.finish(FinishReason.STOP)
        t.check_invariants()
        trajs.append(t)
    terms = RewardTerms(outcome=torch.tensor([1.0, 0.0]), tool_final=torch.zeros(2), tool=[[], []],
                        interaction=[[(1, 1.0)], []], extra={})
    path = write_jsonl(tmp_path_factory.mktemp("rollout_data"), 3, trajectory_records(trajs, terms, [2.0, 0.0], 3, tok))
    return path, trajs, tok


@pytest.mark.unit
def test_dump_holds_ids_mask_logprobs_versions_and_spans_as_the_trajectory_does(dump):
    """Contract: each record's token ids, mask, engine log-probs, weight versions and turn spans equal the
    trajectory's, each span's text is its tokens decoded, and the tokenizer path is recorded."""
    path, trajs, tok = dump
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["uid"] for r in rows] == ["p0/0", "p0/1"]
    for r, t in zip(rows, trajs):
        assert r["prompt_ids"] == t.prompt_ids and r["response_ids"] == t.response_ids
        assert r["response_mask"] == t.response_mask and r["rollout_logprobs"] == t.rollout_logprobs
        assert r["weight_versions"] == t.weight_versions == [1, 2] and r["tokenizer"] == tok.name_or_path
        assert [(s["role"], s["start"], s["end"], s["weight_version"]) for s in r["turns"]] == \
            [(s.role, s.start, s.end, s.weight_version) for s in t.turns]
        for s in r["turns"]:
            assert s["text"] == tok.decode(t.response_ids[s["start"]:s["end"]], skip_special_tokens=False)
            assert set(r["response_mask"][s["start"]:s["end"]]) == {1 if s["role"] == "assistant" else 0}
    assert [s["text"] for s in rows[0]["turns"]] == [text for _, text, _ in SEGMENTS]


@pytest.mark.unit
def test_show_trajectory_prints_every_segment_labelled_and_coloured_by_kind(dump, capsys):
    """Contract: every segment (masked-out ones included) is printed, labelled with its kind, weight version,
    token range and mask; in colour, sampled text is green, tool yellow, user cyan, template grey; `--uid` picks
    the trajectory, an unknown one names the uids the dump holds; a dump directory reads its last step."""
    path, trajs, tok = dump
    show_trajectory.main([str(path), "--uid", "p0/0", "--no-color", "--tokens"])
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert out.startswith("uid p0/0  step 3  data_source openai/gsm8k  finish stop  reward 2.0")
    n0 = len(tok.encode(SEGMENTS[0][1], add_special_tokens=False))
    assert f"--- sampled v1 [0:{n0}, mask 1]\n{SEGMENTS[0][1]}\n--- tool [{n0}:" in out
    for _, text, _ in SEGMENTS:
        assert f"\n{text}\n" in out
    assert "Tom has 3 boxes" in out and "--- user [" in out and "--- template [" in out
    token_lines = out.split("--- tokens: index id mask log-prob version text\n")[1].splitlines()
    assert len(token_lines) == len(trajs[0].response_ids)
    first = token_lines[0].split()
    assert first[:5] == ["0", str(trajs[0].response_ids[0]), "1", "-0.2500", "1"]
    record = show_trajectory.pick(show_trajectory.load_records(path.parent), "p0/0")
    coloured = show_trajectory.render(record, tok, color=True)
    for kind, text, _ in SEGMENTS:
        assert f"\x1b[{show_trajectory.COLORS[kind]}m{text}\x1b[0m" in coloured
    with pytest.raises(SystemExit, match="no trajectory with --uid p9/9; the dump holds p0/0, p0/1"):
        show_trajectory.main([str(path), "--uid", "p9/9"])


@pytest.mark.unit
def test_show_trajectory_command_is_plain_when_not_a_terminal(dump):
    """Contract: `python -m recipe.show_trajectory DUMP` with stdout a pipe prints plain text (no escapes),
    decoding with the tokenizer path the dump records; the first trajectory by default."""
    path, _, _ = dump
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NO_COLOR", None)
    out = subprocess.run([sys.executable, "-m", "recipe.show_trajectory", str(path)], check=False,
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("uid p0/0 ") and "\x1b[" not in out.stdout and "\n#### 12\n" in out.stdout
