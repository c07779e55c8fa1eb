"""End to end: the cpu_tiny run saves a checkpoint every step, and a trainer resumed from one continues where it
stopped (real Megatron actor + reference, SGLang CPU engine, Ray; one build).

The run trains 2 steps with trainer.save_freq=1; the same trainer is then resumed from global_step_1 (what
`recipe.main_ppo.build` calls once `trainer.resume_mode` names a checkpoint) and trains step 2 again.
Restoring into the live groups checks what was loaded from the shards, not what was in memory: the actor
holds step 2's weights when it is resumed to step 1's. (A resume in fresh processes is
tests/test_checkpoint.py's, at the Megatron level.)
"""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe import checkpoint
from recipe.config_schema import PPOConfig
from recipe.data import gsm8k
from tests.test_trainer_e2e import CONFIG_DIR, RECORDS, actor_log_probs, probe


def _recording(batches, seen: list[list[str]]):
    for b in batches:
        seen.append([p.uid for p in b.prompts])
        yield b


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import ray
    from transformers import AutoTokenizer

    from recipe.main_ppo import build

    root = tmp_path_factory.mktemp("resume")
    for split in gsm8k.SPLITS:
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    data = gsm8k.preprocess(root / "data", root)
    out = root / "out"
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="cpu_tiny", overrides=[
            f"data.train_files=[{data['train']}]", f"trainer.default_local_dir={out}", "trainer.total_training_steps=2",
            "trainer.save_freq=1", "trainer.logger=[console,wandb]", "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.use_kl_loss=false", "data.max_response_length=24"])  # no reference group: faster
    trainer, batches = build(PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True)))
    first, again = itertools.tee(batches)
    seen_first, seen_again = [], []
    res = {"out": out, "weights": {}, "dirs": {}}
    save = trainer.save_checkpoint

    def save_and_record():  # the first save of each step: the actor weights saved, the checkpoints present after
        res["weights"].setdefault(trainer.global_step, trainer.workers.actor.call_all("hf_state_dict")[0])
        path = save()
        res["dirs"].setdefault(trainer.global_step, sorted(p.name for p in out.glob("global_step_*")))
        return path

    trainer.save_checkpoint = save_and_record
    try:
        trainer.fit(_recording(first, seen_first))  # steps 1 and 2, a checkpoint after each
        res["wandb_id"] = trainer.tracker.run_id
        res["auto"] = checkpoint.resume_dir("auto", out, None)
        trainer.resume(out / "global_step_1", again)
        res["resumed"] = trainer.workers.actor.call_all("hf_state_dict")[0]
        res["global_step"], res["weight_version"] = trainer.global_step, trainer.weight_version
        tok = AutoTokenizer.from_pretrained(str(out / "tiny_model"))
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 boxes of 4 apples."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
        res["engine_probe"] = probe(trainer.workers.engines[0], prompt_ids)
        res["actor_probe"] = actor_log_probs(trainer, prompt_ids, res["engine_probe"][0])
        trainer.fit(_recording(again, seen_again))  # step 2 again
        res["global_step_end"] = trainer.global_step
    finally:
        trainer.close()
        ray.shutdown()
    res["seen_first"], res["seen_again"] = seen_first, seen_again
    return res


@pytest.mark.e2e
def test_checkpoints_every_step_and_auto_picks_the_newest(run):
    """Contract: save_freq=1 writes global_step_<k> after each step, the marker names the newest, which auto
    resume picks; the trainer state holds the step, the weight version, the sampler position and the wandb id."""
    assert run["dirs"] == {1: ["global_step_1"], 2: ["global_step_1", "global_step_2"]}
    assert run["auto"] == run["out"] / "global_step_2"
    state = checkpoint.TrainerState.read(run["out"] / "global_step_1")
    assert (state.step, state.weight_version, state.batches_consumed) == (1, 1, 1)
    assert state.wandb_run_id == run["wandb_id"] is not None


@pytest.mark.e2e
def test_resume_restores_the_actor_syncs_the_engines_and_continues_the_step(run):
    """Contract: resuming from global_step_1 restores the actor's weights exactly as saved (not the step-2 weights it
    held), publishes them to the engine under version 1 before any rollout (engine log-probs = actor's), and the
    next step is step 2 on the prompt batch the first run drew for step 2."""
    saved, later = run["weights"][1], run["weights"][2]
    assert any(not torch.equal(later[k], saved[k]) for k in saved)  # the resume has work to do
    assert run["resumed"].keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(run["resumed"][k], v), f"{k} differs from the saved checkpoint"
    assert (run["global_step"], run["weight_version"]) == (1, 1)
    ids, engine_lp, version = run["engine_probe"]
    assert version == 1 and len(ids) > 0
    assert max(abs(a - b) for a, b in zip(engine_lp, run["actor_probe"])) < 1e-3
    assert run["global_step_end"] == 2
    assert run["seen_again"] == run["seen_first"][1:2]  # the sampler continued at the second batch
    steps = [json.loads(x)["step"] for x in (run["out"] / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 2]
