"""End to end: the cpu_tiny preset trains GRPO, PPO (GAE), RLOO, REINFORCE++ and ReMax for 2 steps each,
one after the other, on a tiny GSM8K parquet made here (plus unit tests of the trainer's own pieces).

Real parts throughout: the tiny Qwen2 checkpoint written by the preset, SGLang's CPU engine,
Megatron-Core actor + reference + critic on one Ray cluster, the gsm8k tool and interaction, and a
verl-style `custom_reward_function` (a file written here) whose scores vary from sample to sample,
so every estimator sees non-trivial advantages from a random tiny model. The run is built once
(with the critic GAE needs) and the estimators take turns on it: one engine start, one Ray
cluster. The learning rate is raised so that two steps move the policy measurably.
"""
from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import torch

from megatron_workers.weights import bucket_by_bytes
from recipe.config_schema import PPOConfig
from recipe.tasks import gsm8k
from recipe.batch import collate
from recipe.group_filter import trainable
from recipe.rollouts import rollout_with_timeout
from recipe.step_metrics import rollout_probs_diff
from rollout.trajectory import FinishReason, Trajectory

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "recipe" / "config")
STEPS = 2
RECORDS = [
    {"question": f"Tom has {a} boxes with {b} apples each. How many apples?", "answer": f"{a}*{b}={a * b}\n#### {a * b}"}
    for a, b in [(3, 4), (5, 6), (7, 2), (8, 9), (2, 2), (6, 3), (4, 4), (9, 1)]
]


def probe(engine, prompt_ids: list[int], n: int = 8):
    """Greedy continuation of `prompt_ids` on the engine: (ids, logprobs, weight version)."""
    res = asyncio.run(engine.generate(prompt_ids, {"max_new_tokens": n, "temperature": 0.0}, f"probe-{id(prompt_ids)}"))
    return res.output_ids, res.output_logprobs, res.weight_version


def actor_log_probs(trainer, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """The actor's log-probs of `ids` after `prompt_ids`, through the same batch layout the trainer uses."""
    from megatron_workers.worker_group import concat_results

    traj = Trajectory(uid="probe", prompt_uid="probe", sample_index=0, prompt_ids=list(prompt_ids))
    traj.append_assistant(ids, [0.0] * len(ids), 0)
    batch = collate([traj], pad_token_id=0)
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    out = concat_results(trainer.workers.actor.dispatch("compute_log_prob", {k: batch[k] for k in keys}))
    return out["log_probs"][0].tolist()


@pytest.mark.unit
def test_weight_buckets_keep_order_and_respect_the_byte_budget():
    """Contract: buckets hold every tensor once, in order, each within the byte budget unless a single
    tensor is larger than the budget (then it travels alone)."""
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 20, 5, 100, 1, 1])]
    buckets = list(bucket_by_bytes(named, bucket_bytes=30 * 4))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_by_bytes(named, 0))


def _sampled(uid: str, mask: list[int]) -> Trajectory:
    t = Trajectory(uid=uid, prompt_uid=uid, sample_index=0, prompt_ids=[1])
    for m in mask:
        t.append_assistant([5], [0.0], 0) if m else t.append_context([6], "tool")
    return t


@pytest.mark.unit
def test_trainable_drops_empty_responses_and_fits_the_split():
    """Contract: trajectories without a sampled token are dropped, then the count is cut to a multiple of
    mini-batches x DP ranks, keeping batch order."""
    trajs = [_sampled(str(i), m) for i, m in enumerate([[1, 0], [0, 0], [1, 1], [0, 1], [1, 0], []])]
    assert [t.uid for t in trainable(trajs, 1)] == ["0", "2", "3", "4"]
    assert [t.uid for t in trainable(trajs, 3)] == ["0", "2", "3"]
    assert trainable(trajs, 8) == []


@pytest.mark.unit
def test_rollout_probs_diff_is_verls_metric_over_sampled_tokens():
    """Contract: training/rollout_probs_diff_{mean,max,std} = |exp(actor) - exp(engine)| over sampled tokens only."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.3, 0.3]]))
    engine = torch.log(torch.tensor([[0.4, 0.1, 0.9], [0.2, 0.3, 0.9]]))
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    m = rollout_probs_diff(old, engine, mask)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1, abs=1e-6)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.025, abs=1e-6)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(torch.tensor([0.1, 0, 0, 0]).std().item(), abs=1e-6)


@pytest.mark.unit
def test_rollout_past_its_time_limit_is_aborted(tiny_model_dir):
    """Contract: a rollout running past trainer.rollout_timeout_s is aborted through AgentLoop.abort: hung requests
    end as aborted with what they sampled, finished ones are kept, and the call returns."""
    from transformers import AutoTokenizer

    from tests.test_agent_loop import ScriptedEngine, _loop, _prompt

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    engine = ScriptedEngine(tokenizer, lambda uid, turn: None if uid.startswith("hang") else "#### 5")
    loop = _loop(tokenizer, engine)
    trajs = asyncio.run(rollout_with_timeout(loop, [_prompt("hang"), _prompt("ok")], timeout_s=0.5))
    assert [t.finish_reason for t in trajs] == [FinishReason.ABORTED, FinishReason.STOP]
    assert engine.aborted == ["hang/0#0"] and sum(trajs[0].response_mask) > 0


ESTIMATORS = ("grpo", "gae", "rloo", "reinforce_plus_plus", "remax")
CUSTOM_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    # a deterministic score that differs between samples (a random model never solves GSM8K)
    return {"score": (sum(map(ord, solution_str)) % 97) / 96.0, "chars": float(len(solution_str))}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Build the cpu_tiny run once (with a critic), probe the engine, then train STEPS steps with each estimator in
    turn, measuring the actor's log-probs on a fixed probe before and after each; then shut everything down."""
    import ray
    from transformers import AutoTokenizer

    from recipe.main_ppo import build

    root = tmp_path_factory.mktemp("e2e")
    for split in gsm8k.SPLITS:
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    data = gsm8k.preprocess(root / "data", root)
    (root / "reward.py").write_text(CUSTOM_REWARD)
    out_dir = root / "out"
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="cpu_tiny", overrides=[
            f"data.train_files=[{data['train']}]", f"trainer.default_local_dir={out_dir}",
            f"trainer.total_training_steps={STEPS * len(ESTIMATORS)}", "trainer.logger=[console,wandb]",
            "actor_rollout_ref.actor.optim.lr=1e-2", "critic.optim.lr=1e-3", "algorithm.adv_estimator=gae",
            f"custom_reward_function.path={root / 'reward.py'}", f"data.val_files=[{data['test']}]",
            "trainer.log_val_generations=2", f"trainer.validation_data_dir={out_dir / 'val_data'}",
            f"trainer.rollout_data_dir={out_dir / 'rollout_data'}"])
    config_dict = OmegaConf.to_container(cfg, resolve=True)
    config = PPOConfig.from_dict(config_dict)
    trainer, batches = build(config, config_dict)
    engine, critic = trainer.workers.engines[0], trainer.workers.critic
    assert critic is not None
    try:
        tok = AutoTokenizer.from_pretrained(str(out_dir / "tiny_model"))
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 boxes of 4 apples."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
        before = probe(engine, prompt_ids)
        result = {"out_dir": out_dir, "before": before, "estimators": {}}
        step = 0
        for estimator in ESTIMATORS:
            # the estimators take turns on one built run: the algorithm section and the critic (GAE only) change
            config.algorithm.adv_estimator = estimator
            trainer.workers.critic = critic if estimator == "gae" else None
            start = actor_log_probs(trainer, prompt_ids, before[0])
            metrics = []
            for _ in range(STEPS):
                step += 1
                metrics.append(trainer.step(step, lambda: next(batches)))
            moved = max(abs(a - b) for a, b in zip(start, actor_log_probs(trainer, prompt_ids, before[0])))
            result["estimators"][estimator] = {"metrics": metrics, "moved": moved}
        result["val"] = trainer.validate(step)  # greedy (val_kwargs' default) over the 8 held-out prompts
        after = probe(engine, prompt_ids)
        result.update(after=after, engine_version=engine.weight_version,
                      actor_on_after=actor_log_probs(trainer, prompt_ids, after[0]),
                      actor_on_before=actor_log_probs(trainer, prompt_ids, before[0]))
    finally:
        trainer.workers.critic = critic  # close() stops every group
        trainer.close()
        ray.shutdown()
    return result


@pytest.mark.e2e
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimator_trains_two_steps_end_to_end(run, estimator):
    """Contract: each estimator runs 2 full steps (rollout, custom reward, log-probs, advantages, update, sync) with
    finite metrics, non-trivial advantages, and an actor whose weights changed; the engine samples with the synced
    weights (train/rollout probability gap small); ReMax gets its greedy-rollout baselines, GAE its critic."""
    res = run["estimators"][estimator]
    for m in res["metrics"]:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert m["rollout/num_trajectories"] == 4 * 2  # train_batch_size x n
        assert "reward/extra/chars/mean" in m  # the custom function's dict result reached the metrics
        assert m["training/rollout_probs_diff_max"] < 1e-2  # fp32 engine and actor, weights synced every step
    assert any(m["critic/advantages/max"] > m["critic/advantages/min"] for m in res["metrics"])
    assert res["moved"] > 1e-4, "two updates left the actor's log-probs unchanged"
    keys = set().union(*res["metrics"])
    if estimator == "remax":
        assert {"critic/reward_baselines/mean", "timing/rollout_greedy_s"} <= keys
    assert ("critic/vf_loss" in keys and "critic/values/mean" in keys) == (estimator == "gae")


@pytest.mark.e2e
def test_run_writes_metrics_for_every_step(run):
    """Contract: the run writes one metrics record per step to the jsonl file, with the rollout, actor, timing and
    perf metrics, each step sampled on the weights of the previous step's sync."""
    lines = [json.loads(x) for x in (run["out_dir"] / "metrics.jsonl").read_text().splitlines()]
    lines = [m for m in lines if "timing/validation_s" not in m]  # the validation's own record
    assert [m["step"] for m in lines] == list(range(1, STEPS * len(ESTIMATORS) + 1))
    for m in lines:
        for key in ("rollout/num_trajectories", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr",
                    "critic/score/mean", "critic/advantages/mean", "timing/rollout_s", "timing/update_actor_s",
                    "timing/sync_weights_s", "perf/tokens_per_s", "perf/throughput", "perf/time_per_step"):
            assert key in m and m[key] is not None, key
        assert m["trainer/weight_version"] == m["step"]
        assert m["rollout/weight_version_min"] == m["step"] - 1


@pytest.mark.e2e
def test_wandb_offline_run_reads_back(run):
    """Contract: with trainer.logger=[console,wandb] (WANDB_MODE=offline here) the run's wandb transaction log, read
    back record by record (tests/test_wandb_offline.py), holds every step's metrics with the values of
    metrics.jsonl (actor/, timing/, perf/ among them), the validation's val-core/ metrics, and the val/generations
    table with trainer.log_val_generations rows of the validation's columns."""
    from recipe.validation import TABLE_COLUMNS
    from tests.test_wandb_offline import read_offline_run

    (run_dir,) = (run["out_dir"] / "wandb").glob("offline-run-*")
    wb = read_offline_run(run_dir)
    steps = STEPS * len(ESTIMATORS)
    assert sorted(wb.history) == list(range(1, steps + 1))
    for m in (json.loads(x) for x in (run["out_dir"] / "metrics.jsonl").read_text().splitlines()):
        row = wb.history[m["step"]]
        for key in ("actor/pg_loss", "actor/grad_norm", "timing/step_s", "timing/update_actor_s", "perf/throughput"):
            assert key in row or "timing/validation_s" in m, (m["step"], key)
        for key, value in m.items():
            if key != "step" and value is not None:
                assert row[key] == pytest.approx(value, rel=1e-12), (m["step"], key)
    val_key = f"val-core/{gsm8k.DATA_SOURCE}/reward/mean@1"
    assert wb.history[steps][val_key] == pytest.approx(run["val"][val_key])
    table = wb.table("val/generations", steps)
    assert table["columns"] == TABLE_COLUMNS and len(table["data"]) == 2  # trainer.log_val_generations=2


@pytest.mark.e2e
def test_engine_weights_equal_actor_after_sync(run):
    """Contract: every step bumps the engine's weight version, and after the last sync the engine computes
    the actor's log-probs (greedy tokens, fp32, within 1e-3) while the policy moved away from the start."""
    steps = STEPS * len(ESTIMATORS)
    assert run["before"][2] == 0 and run["engine_version"] == steps and run["after"][2] == steps
    ids, engine_lp, _ = run["after"]
    assert len(ids) == len(engine_lp) > 0
    assert max(abs(a - b) for a, b in zip(engine_lp, run["actor_on_after"])) < 1e-3
    # The trained actor no longer gives the initial engine's log-probs: the check above is not vacuous.
    assert max(abs(a - b) for a, b in zip(run["before"][1], run["actor_on_before"])) > 1e-2


@pytest.mark.e2e
def test_validation_metrics_and_jsonl_records(run):
    """Contract: a validation rolls the held-out prompts out through the same agent loop (greedy: one sample each)
    and logs verl's val-core/<data_source>/reward/mean@1 with the tool-call rate and turns; the per-step rollout and
    validation JSONL files hold prompt, response, tool calls, rewards and finish reason for every trajectory."""
    steps = STEPS * len(ESTIMATORS)
    val = run["val"]
    source = gsm8k.DATA_SOURCE
    assert 0.0 <= val[f"val-core/{source}/reward/mean@1"] <= 1.0
    assert 0.0 <= val[f"val-aux/{source}/tool_call_rate"] <= 1.0 and val[f"val-aux/{source}/num_turns/mean"] >= 1.0
    logged = [json.loads(x) for x in (run["out_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if f"val-core/{source}/reward/mean@1" in m] == [steps]
    fields = {"prompt", "response", "tool_calls", "rewards", "finish_reason", "data_source", "step"}
    val_rows = [json.loads(x) for x in (run["out_dir"] / "val_data" / f"{steps}.jsonl").read_text().splitlines()]
    assert len(val_rows) == len(RECORDS) and all(fields <= set(r) for r in val_rows)
    assert all(r["prompt"][-1]["role"] == "user" and r["finish_reason"] for r in val_rows)
    for step in range(1, steps + 1):
        rows = [json.loads(x) for x in (run["out_dir"] / "rollout_data" / f"{step}.jsonl").read_text().splitlines()]
        assert rows and all(fields <= set(r) and r["step"] == step for r in rows)


@pytest.mark.e2e
def test_rollout_dump_holds_what_was_trained_and_show_trajectory_prints_it(run, capsys):
    """Contract (issue 16): the cpu_tiny run's rollout dump holds each trajectory's token ids, mask, engine log-probs
    and weight versions (turn spans tile the response; mask 1 and a log-prob <= 0 exactly on sampled spans, which
    carry the step's rollout weight version), and `python -m recipe.show_trajectory <dump dir>` prints the last
    step's trajectory with every span's text, decoded with the tokenizer the dump names."""
    from recipe import show_trajectory

    steps = STEPS * len(ESTIMATORS)
    logged = [json.loads(x) for x in (run["out_dir"] / "metrics.jsonl").read_text().splitlines()]
    version = int(next(m["rollout/weight_version_min"] for m in logged
                       if m["step"] == steps and "rollout/sampled_tokens" in m))
    rows = [json.loads(x) for x in (run["out_dir"] / "rollout_data" / f"{steps}.jsonl").read_text().splitlines()]
    for r in rows:
        n = len(r["response_ids"])
        assert len(r["response_mask"]) == len(r["rollout_logprobs"]) == n == r["response_tokens"] > 0
        assert [s["start"] for s in r["turns"]] == [0] + [s["end"] for s in r["turns"][:-1]] and r["turns"][-1]["end"] == n
        for s in r["turns"]:
            sampled = s["role"] == "assistant"
            assert set(r["response_mask"][s["start"]:s["end"]]) <= {int(sampled)}
            assert s["weight_version"] == (version if sampled else None)
        assert all(lp <= 0 if m else lp == 0 for lp, m in zip(r["rollout_logprobs"], r["response_mask"]))
        assert r["weight_versions"] == [version] * r["num_turns"]
    show_trajectory.main([str(run["out_dir"] / "rollout_data"), "--uid", rows[-1]["uid"], "--no-color"])
    out = capsys.readouterr().out
    assert out.startswith(f"uid {rows[-1]['uid']}  step {steps}  data_source {gsm8k.DATA_SOURCE}")
    assert all(s["text"] in out for s in rows[-1]["turns"]) and f"--- sampled v{version} [0:" in out
