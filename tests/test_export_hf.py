"""HF export of a trainer checkpoint (`python -m recipe.export_hf`), loaded by transformers and by SGLang.

A Megatron actor group at TP=2 (real ranks on Ray) takes a PPO step and is checkpointed the way the
trainer does it (`recipe.checkpoint.save`: `global_step_1/actor/` + `trainer_state.json`). The CLI exports the
run directory (so: its newest checkpoint) in fresh processes. The export is compared with the live actor:
weights bit-equal, transformers' log-probs of every response token (log-softmax of its logits) within 1e-4 of
the actor's (fp32), and the session's SGLang CPU engine, loaded from the export, greedy-decodes the ids
transformers does, log-probs within 1e-3.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe import checkpoint
from recipe.export_hf import actor_shards, find_checkpoint, hf_source
from tests.conftest import local_ray_cluster
from tests.test_actor import _vocab, build_actor, hf_log_probs, hf_weights, make_batch, ppo_batch, update
from tests.test_sglang_engine import PROMPTS, _hf_greedy

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir):
    """Train one step at TP=2, checkpoint it as the trainer does, export the run directory with the CLI."""
    from megatron_workers.worker_group import MegatronWorkerGroup, ParallelLayout, concat_results

    root = tmp_path_factory.mktemp("export")
    run_dir, out = root / "run", root / "hf"
    batch = make_batch(_vocab(tiny_model_dir), seed=8)
    with local_ray_cluster(tmp_path_factory, num_cpus=4, pickle_by_value="tests.test_actor"):
        group = MegatronWorkerGroup(ParallelLayout(tp=2), seed=1)
        try:
            build_actor(group, tiny_model_dir, ppo_micro_batch_size_per_gpu=2)
            update(group, ppo_batch(tiny_model_dir, seed=5), mini_batch_size=4)
            weights = hf_weights(group)
            actor_lp = concat_results(group.dispatch("compute_log_prob", batch))["log_probs"]  # (B, T)
            state = checkpoint.TrainerState(step=1, weight_version=1, kl_coef=0.0, batches_consumed=1, epoch=0)

            def write(directory: Path) -> None:  # what Trainer.save_checkpoint writes
                group.call_all("save_checkpoint", str(directory / "actor"))
                state.write(directory)

            checkpoint.save(run_dir, 1, write)
        finally:
            group.shutdown()
    proc = subprocess.run([sys.executable, "-m", "recipe.export_hf", str(run_dir), str(out), "--dtype", "float32"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "summary": json.loads(proc.stdout.strip().splitlines()[-1]), "weights": weights,
            "batch": batch, "actor_lp": actor_lp, "run_dir": run_dir}


@pytest.mark.integration
def test_export_equals_the_trained_actor_in_transformers(exported, tiny_model_dir):
    """Contract: the CLI, given a run directory, exports its newest checkpoint (here TP=2: each rank must load its own
    shard) into a dir transformers loads (model and tokenizer) holding exactly the actor's weights, whose
    response-token log-probs equal the Megatron actor's within 1e-4 (fp32). (Which file each TP x PP x DP rank
    reads is the unit test's below; the TP/PP gather is megatron_workers.model's, parity-tested at TP=2 x PP=2.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_workers import checkpoint as mckpt
    from recipe import export_hf

    assert export_hf.HF_DIR == mckpt.HF_DIR  # where the actor saves config + tokenizer, where the CLI reads them
    out, weights = exported["out"], exported["weights"]
    s = exported["summary"]
    assert (s["checkpoint"], s["step"], s["tp"], s["pp"], s["tensors"]) == (
        str(exported["run_dir"] / "global_step_1"), 1, 2, 1, len(weights))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in weights.items()), "the update did not move the actor"
    for k, v in weights.items():
        assert torch.equal(loaded[k], v), f"exported {k} differs from the actor's weights"
    assert AutoTokenizer.from_pretrained(out).get_chat_template() == AutoTokenizer.from_pretrained(
        tiny_model_dir).get_chat_template()
    hf_lp, _ = hf_log_probs(out, exported["batch"])
    torch.testing.assert_close(exported["actor_lp"], hf_lp, rtol=0, atol=1e-4)


@pytest.mark.integration
def test_sglang_serves_the_export_as_transformers_does(exported, sglang_engine, tiny_model_dir):
    """Contract: the SGLang CPU engine loads the export (update_weights_from_disk): its greedy ids equal
    transformers' greedy generate on the export, log-probs within 1e-3, and differ from the initial model's
    log-probs (the engine really serves the trained weights). The session engine is restored afterwards."""
    from transformers import AutoTokenizer

    out = exported["out"]
    tok = AutoTokenizer.from_pretrained(out)
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]
    params = {"max_new_tokens": 12, "temperature": 0.0}

    def greedy(tag: str):
        async def run():
            return await asyncio.gather(*[sglang_engine.generate(ids, params, f"export-{tag}-{i}")
                                          for i, ids in enumerate(prompt_ids)])
        return asyncio.run(run())

    version = sglang_engine.weight_version
    before = greedy("before")
    sglang_engine.update_weights_from_disk(str(out), weight_version=version + 1)
    try:
        served = greedy("export")
    finally:
        sglang_engine.update_weights_from_disk(str(tiny_model_dir), weight_version=version + 2)
    assert [r.output_ids for r in greedy("restored")] == [r.output_ids for r in before]
    moved = 0.0
    for ids, res, old in zip(prompt_ids, served, before):
        hf_ids, hf_lp = _hf_greedy(out, ids, len(res.output_ids))
        assert res.output_ids == hf_ids
        assert max(abs(a - b) for a, b in zip(res.output_logprobs, hf_lp)) < 1e-3
        moved = max(moved, abs(res.output_logprobs[0] - old.output_logprobs[0]))
    assert moved > 1e-3, "the engine served the same log-probs as the initial model"


def _fake_rank_files(directory: Path, tp: int, pp: int, dp: int) -> None:
    """Rank files in Megatron's rank order (tp fastest, then dp, then pp), each recording its coordinates."""
    directory.mkdir(parents=True)
    rank = 0
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                torch.save({"coords": (t, p, d), "model": {}}, directory / f"rank_{rank:05d}.pt")
                rank += 1
    (directory / "meta.json").write_text(json.dumps({"world_size": rank, "tp": tp, "pp": pp, "dp": dp, "step": 3}))


@pytest.mark.unit
def test_checkpoint_lookup_picks_dp_rank_zero_shards_and_names_what_is_missing(tmp_path):
    """Contract: a run directory resolves to the checkpoint its marker names; with DP > 1 each (tp, pp) coordinate
    reads DP rank 0's file (not simply the first TP x PP ranks); an incomplete checkpoint, a directory that is no
    checkpoint, and a checkpoint without a model config are refused naming the fix."""
    ckpt = tmp_path / "run" / "global_step_3"
    _fake_rank_files(ckpt / "actor", tp=2, pp=2, dp=2)
    (tmp_path / "run" / checkpoint.MARKER).write_text("3\n")
    assert find_checkpoint(tmp_path / "run") == ckpt and find_checkpoint(ckpt) == ckpt
    shards = actor_shards(ckpt)
    assert (shards.tp, shards.pp, shards.dp) == (2, 2, 2)
    assert {c: f.name for c, f in shards.files.items()} == {
        (0, 0): "rank_00000.pt", (1, 0): "rank_00001.pt", (0, 1): "rank_00004.pt", (1, 1): "rank_00005.pt"}
    (ckpt / "actor" / "rank_00005.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"no DP-rank-0 shard for \(tp rank, pp rank\) \[\(1, 1\)\]"):
        actor_shards(ckpt)
    with pytest.raises(FileNotFoundError, match="give <trainer.default_local_dir>/global_step_<k>"):
        find_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="pass --hf-source"):
        hf_source(ckpt, None)
