"""Benchmark: the three schedules (`async_training.schedule`) training the same seeded multi-turn workload.

`python -m benchmarks.async_training [--steps 8 --prompts 4 --n 4 --seed 0] [--smoke]` starts one run's workers
once, in separate placement (one SGLang CPU engine, one Megatron rank: the cpu_tiny preset's tiny model, GRPO, no
reference), then trains `--steps` steps in `sync`, `one_step_off` and `fully_async` in turn, each from the same
weights (the actor's checkpoint after the warm-up step, reloaded and synced as version 0 first) and on the same
prompts.

The workload: every trajectory makes one or two calls of a `wait` tool, then answers. Its text lengths vary per turn
(8, 32 or 96 letters) and are held with SGLang's `regex` sampling parameter (the tiny random model would not call
tools by itself); the tool sleeps 50 ms for 90% of calls and `--slow-s` (2 s) for the others, a long tail. All of
it is a function of the prompt's uid, sample and turn (seeded), so each schedule meets the same work. A warm-up step
runs first (not timed).

Last line, JSON (RESULT_KEYS): per schedule `<schedule>_steps_per_h`, `<schedule>_engine_busy`,
`<schedule>_trainer_busy`, `<schedule>_mean_staleness`, `<schedule>_max_staleness`; `fully_async_speedup` (its
steps per hour over sync's); `staleness_bound` and `max_staleness` (fully_async's). Goal: fully_async at least 1.6x
sync, with `max_staleness <= staleness_bound`. `--smoke`: 2 steps of 2 prompts x 2 samples with short waits, the
same code path (the suite runs it; its figures mean nothing).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import rollout_overlap
from recipe.async_config import SCHEDULES
from rollout.engines.base import GenerateResult
from rollout.tools.base import BaseTool
from rollout.tools.schemas import OpenAIFunctionToolSchema

logger = logging.getLogger("benchmarks.async_training")

RESULT_KEYS = ("sync_steps_per_h", "sync_engine_busy", "sync_trainer_busy", "sync_mean_staleness",
               "sync_max_staleness", "one_step_off_steps_per_h", "one_step_off_engine_busy",
               "one_step_off_trainer_busy", "one_step_off_mean_staleness", "one_step_off_max_staleness",
               "fully_async_steps_per_h", "fully_async_engine_busy", "fully_async_trainer_busy",
               "fully_async_mean_staleness", "fully_async_max_staleness", "fully_async_speedup", "staleness_bound",
               "max_staleness")  # a literal: tests/test_benchmarks.py reads it without importing
LENGTHS = (8, 32, 96)  # letters of free text before each call or answer
FAST_S, SLOW_FRACTION = 0.05, 0.1
TOOL = "wait"
SEPARATE = ["actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"]


def _draw(*key: Any) -> float:
    """A uniform draw in [0, 1) that is a function of `key` only (the workload's seed included)."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2 ** 64


class Workload:
    """The seeded work of a trajectory (`<prompt uid>/<sample>`): its tool calls, text lengths and tool latencies."""

    slow_s = 2.0

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def calls(self, traj: str) -> int:
        return 1 + int(_draw(self.seed, traj, "calls") < 0.5)

    def latency(self, traj: str, turn: int) -> float:
        return self.slow_s if _draw(self.seed, traj, turn, "slow") < SLOW_FRACTION else FAST_S

    def regex(self, traj: str, turn: int) -> str:
        """Turn `turn`'s text: free letters of the seeded length, then a `wait` call (or the answer, 0 or 1)."""
        text = f"[a-z ]{{{LENGTHS[int(_draw(self.seed, traj, turn, 'len') * len(LENGTHS))]}}}"
        if turn < self.calls(traj):
            args = r'\{"key": "' + re.escape(traj) + r'", "turn": ' + str(turn) + r'\}'
            return text + r'\n<tool_call>\n\{"name": "' + TOOL + r'", "arguments": ' + args + r'\}\n</tool_call>'
        return text + r"\n#### [01]"


WORK = Workload(seed=0)  # the tool, built by the registry from its YAML, reads the run's workload here


class WaitTool(BaseTool):
    """Sleeps the workload's latency for the (trajectory, turn) named in its arguments; answers "ok"."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        super().__init__({"timeout_s": 30.0, "max_concurrency": 1024, **config}, tool_schema)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        import asyncio

        await asyncio.sleep(WORK.latency(parameters["key"], int(parameters["turn"])))
        return "ok", 0.0, {}


class SteeredEngine(rollout_overlap.SteeredEngine):
    """An engine client with the workload's regex of each turn added to its requests (health probes untouched)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, WORK)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> GenerateResult:
        if "#" in request_id:  # "<traj uid>#<turn>[.<part after a pause>]"
            traj, turn = request_id.rsplit("#", 1)
            sampling_params = dict(sampling_params, regex=WORK.regex(traj, int(turn.split(".")[0])))
        return await self.engine.generate(input_ids, sampling_params, request_id)


class Recorder:
    """The tracker: every step's metrics."""

    run_id = None

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.steps.setdefault(step, {}).update(metrics)

    def log_table(self, *args: Any, **kwargs: Any) -> None: ...
    def finish(self) -> None: ...


def _write_inputs(out: Path, prompts: int) -> tuple[Path, Path]:
    """The data (`prompts` rows that ask for the wait tool) and the tool config."""
    from recipe.tasks import write_rows

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"Task {i}: wait, then say 1."}],
             "reward_model": {"style": "rule", "ground_truth": "1"},
             "extra_info": {"index": i}} for i in range(prompts)]  # no tools_kwargs: every tool (the wait tool)
    data = out / "train.parquet"
    write_rows(rows, data)
    tools = out / "tools.yaml"
    schema = {"type": "function", "function": {"name": TOOL, "description": "wait for a result", "parameters": {
        "type": "object", "properties": {"key": {"type": "string"}, "turn": {"type": "integer"}},
        "required": ["key", "turn"]}}}
    tools.write_text(f"tools:\n  - class_name: {__name__}.WaitTool\n    config: {{type: native}}\n"
                     f"    tool_schema: {json.dumps(schema)}\n")
    return data, tools


def _config(out: Path, args: argparse.Namespace, schedule: str, steps: int) -> Any:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipe.config_build import register_schema
    from recipe.config_schema import PPOConfig
    from recipe.launch import CONFIG_DIR, PPO

    register_schema(PPO.schema_node, PPO.schema)
    data, tools = out / "train.parquet", out / "tools.yaml"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="cpu_tiny", overrides=[
            f"data.train_files=[{data}]", f"trainer.default_local_dir={out / 'run'}", f"trainer.seed={args.seed}",
            f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            f"actor_rollout_ref.rollout.n={args.n}", "data.max_response_length=1024",
            "actor_rollout_ref.rollout.max_total_tokens=65536", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.megatron.param_offload=false",
            "actor_rollout_ref.actor.megatron.grad_offload=false",
            "actor_rollout_ref.actor.megatron.optimizer_offload=false",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
            "actor_rollout_ref.rollout.multi_turn.interaction_config_path=null",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "trainer.rollout_data_dir=null",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.val_before_train=false", f"async_training.schedule={schedule}", *SEPARATE])
    return PPOConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def _train(schedule: str, steps: int, out: Path, args: argparse.Namespace, prepared: Any, workers: Any,
           start: Path) -> dict[str, float]:
    """`steps` steps of `schedule` from the starting checkpoint; its figures."""
    from recipe.trainer import Trainer
    from rollout.agent_loop import AgentLoop

    cfg = _config(out, args, schedule, steps)
    loop = AgentLoop([SteeredEngine(e) for e in workers.engines], prepared.tokenizer, cfg.actor_rollout_ref.rollout,
                     tools=prepared.tools, interactions=prepared.interactions,
                     chat_template_kwargs=cfg.data.apply_chat_template_kwargs)
    tracker = Recorder()
    trainer = Trainer(cfg, workers, loop, tracker)
    if start.is_dir():
        workers.actor.call_all("load_checkpoint", str(start))
    trainer.sync_weights(0)  # the engines at version 0, with the starting weights
    batches = prepared.dataset.batches(cfg.data.train_batch_size, seed=args.seed, shuffle=True)
    t0, busy0 = time.monotonic(), loop.router.busy_seconds()
    trainer.fit(batches)
    wall = time.monotonic() - t0
    m = tracker.steps
    trained = [s for s in m.values() if "timing/update_actor_s" in s]
    if len(trained) != steps:
        raise RuntimeError(f"{schedule}: {len(trained)} of {steps} steps trained")
    result = {"steps_per_h": steps / wall * 3600,
              "engine_busy": (loop.router.busy_seconds() - busy0) / wall,
              "trainer_busy": sum(s["perf/trainer_busy_fraction"] * s["timing/step_s"] for s in trained) / wall,
              "mean_staleness": sum(s["rollout/staleness/mean"] for s in trained) / steps,
              "max_staleness": max(s["rollout/staleness/max"] for s in trained),
              "staleness_bound": cfg.async_training.bound}
    logger.info("%s: %d steps in %.1f s (%.0f steps/h), engines busy %.0f%%, trainer busy %.0f%%, staleness mean "
                "%.2f max %g (bound %d)", schedule, steps, wall, result["steps_per_h"], 100 * result["engine_busy"],
                100 * result["trainer_busy"], result["mean_staleness"], result["max_staleness"],
                result["staleness_bound"])
    return result


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompt groups per step (data.train_batch_size)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--slow-s", type=float, default=2.0, help="the long tail's tool latency")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 steps of 2 x 2 trajectories: the code path")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts, args.n, args.slow_s = 2, 2, 2, 0.2
    WORK.seed, WORK.slow_s = args.seed, args.slow_s
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    from megatron_workers import cpu_compat

    cpu_compat.apply_cpu_compat()  # this process's start (it imports the Megatron worker classes)
    import ray

    from recipe import main_ppo

    out = Path(tempfile.mkdtemp(prefix="async-training-"))
    _write_inputs(out, max(4 * args.prompts * (args.steps + 2), 64))
    cfg = _config(out, args, "sync", 1)
    prepared = main_ppo.prepare(cfg)
    main_ppo.start_ray(cfg.ray_init)
    workers = main_ppo.build_workers(cfg, prepared.path, prepared.plan)
    start = out / "start"
    try:
        _train("sync", 1, out, args, prepared, workers, start)  # warm-up: first calls, grammar compiler
        workers.actor.call_all("save_checkpoint", str(start))  # (an optimizer that never stepped has no state)
        logger.info("warm-up done")
        figures = {s: _train(s, args.steps, out, args, prepared, workers, start) for s in SCHEDULES}
    finally:
        for group in workers.groups():
            group.shutdown()
        for engine in workers.engines:
            engine.shutdown()
        if workers.placement is not None:
            workers.placement.shutdown()
        ray.shutdown()
        shutil.rmtree(out, ignore_errors=True)
    result = {f"{s}_{k}": round(v, 3) for s, f in figures.items() for k, v in f.items() if k != "staleness_bound"}
    result["fully_async_speedup"] = round(figures["fully_async"]["steps_per_h"] / figures["sync"]["steps_per_h"], 3)
    result["staleness_bound"] = figures["fully_async"]["staleness_bound"]
    result["max_staleness"] = figures["fully_async"]["max_staleness"]
    logger.info("fully_async / sync = %.2fx (goal >= 1.6), one_step_off / sync = %.2fx; fully_async max staleness "
                "%g <= bound %d", result["fully_async_speedup"],
                figures["one_step_off"]["steps_per_h"] / figures["sync"]["steps_per_h"], result["max_staleness"],
                result["staleness_bound"])
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
