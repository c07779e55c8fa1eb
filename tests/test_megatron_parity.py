"""Megatron-Core at TP x PP (gloo, one process per rank) against transformers' own forward:
logits and next-token log-probs within 1e-4 in fp32, and a bit-exact HF -> Megatron -> HF round trip, for
Qwen2 at four layouts and for the tiny-model kit's Qwen3 at TP=2 x PP=2 (through the CLI)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from megatron_workers import check_parity
from tests.test_model_conversion import write_hf_checkpoint

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[bool, Path]:
    """Seeded Qwen2 checkpoints (4 layers, hidden 64, 4 heads, 2 KV heads, vocab 256, QKV bias), by `tied`."""
    root = tmp_path_factory.mktemp("qwen2")
    return {tied: write_hf_checkpoint(root / f"tied={tied}", tied=tied) for tied in (False, True)}


@pytest.mark.parametrize(
    "tp, pp, tied",
    [(1, 1, False), (2, 1, True), (1, 2, True), (2, 2, False)],
    ids=["tp1pp1-untied", "tp2pp1-tied", "tp1pp2-tied", "tp2pp2-untied"],
)
def test_parity_with_transformers(checkpoints, tp, pp, tied):
    """Contract: at every TP x PP layout, Megatron reproduces transformers' logits and log-probs on a
    right-padded batch within 1e-4, and exporting the loaded shards gives back the checkpoint bit for bit."""
    report = check_parity.run_parity(checkpoints[tied], tp=tp, pp=pp, seed=0)
    assert report.mismatches == []
    assert report.max_abs_logit_diff <= 1e-4
    assert report.max_abs_logprob_diff <= 1e-4
    assert report.roundtrip_exact


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "megatron_workers.check_parity", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )


def test_cli_on_tiny_qwen3_model(tmp_path):
    """Contract: on the kit's tiny Qwen3 (`python -m recipe.tiny_model --arch qwen3`: q/k norms, no QKV
    bias, head_dim 32 != hidden/heads 16) the CLI passes at TP=2 x PP=2 (logits and log-probs within 1e-4
    of transformers', round trip bit-exact), and its last stdout line is the JSON summary."""
    out = tmp_path / "qwen3"
    subprocess.run([sys.executable, "-m", "recipe.tiny_model", "--arch", "qwen3", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]
    proc = _cli("--hf", str(out), "--tp", "2", "--pp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["tp"], summary["pp"], summary["roundtrip_exact"]) == (2, 2, True)
    assert summary["max_abs_logit_diff"] <= 1e-4 and summary["max_abs_logprob_diff"] <= 1e-4


def test_cli_names_the_missing_tensor(checkpoints, tmp_path):
    """Contract: on a checkpoint missing a tensor the CLI exits non-zero and names that tensor."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((checkpoints[False] / "config.json").read_text())
    state = load_file(checkpoints[False] / "model.safetensors")
    del state["model.layers.1.mlp.gate_proj.weight"]
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    proc = _cli("--hf", str(bad), "--tp", "1", "--pp", "2")
    assert proc.returncode == 2
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "missing tensor model.layers.1.mlp.gate_proj.weight" in summary["error"]


@pytest.mark.integration
def test_a_real_disagreement_fails_the_check(checkpoints, monkeypatch):
    """The checker is not a rubber stamp: a 1e-3 change in one reference logit fails it and names where."""
    true_reference = check_parity.hf_reference

    def shifted_reference(hf_dir, batch):
        logits, logprobs = true_reference(hf_dir, batch)
        logits = logits.clone()
        logits[1, 3, 7] += 1e-3
        return logits, logprobs

    monkeypatch.setattr(check_parity, "hf_reference", shifted_reference)
    report = check_parity.run_parity(checkpoints[False], tp=1, pp=1)
    assert not report.passed
    assert report.max_abs_logit_diff > check_parity.TOLERANCE
    assert any("sequence 1, position 3" in m for m in report.mismatches)
