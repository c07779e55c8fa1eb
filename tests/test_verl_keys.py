"""verl v0.9's keys and launch lines against polyturn's table (`recipe.verl_keys.VERL_KEYS`): every key of verl's full
Megatron trainer config is a polyturn key or classified, every refusal names a polyturn key or a fix, "did you mean"
names the real counterpart or nothing, and verl v0.9's launch lines pass `launch.prepare` with no refusal but the
ones listed here, each for something polyturn does not build.

The files are verl's and verl-recipe's, copied unchanged into tests/verl_files/v0_9 (README there: commits, paths).
A .sh line is expanded by bash itself (its variables, arithmetic and arrays), the `python -m` replaced by a printf of
its arguments; verl's `--config-path=config` is dropped (polyturn's configs live in recipe/config: refused with that
fix, tests/test_launch_mistakes.py).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from recipe import launch
from recipe.config_build import dict_keys, flat_keys
from recipe.config_schema import ConfigError, PPOConfig
from recipe.verl_keys import VERL_KEYS

pytestmark = pytest.mark.unit

V0_9 = Path(__file__).resolve().parent / "verl_files" / "v0_9"
KNOWN = set(flat_keys(PPOConfig))
SECTIONS = {k.rsplit(".", i)[0] for k in KNOWN for i in range(1, k.count(".") + 1)}
TOP = {k.split(".", 1)[0] for k in KNOWN}

# What each line asks that polyturn does not build: the refusals a run of it still gets, and why that is right.
NOT_BUILT = {
    "grpo_qwen35_35b_megatron_async.sh": {
        "data.truncation": "left-truncating prompts is not built (long prompts are dropped)",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "no MoE model, so no expert parallelism",
        "actor_rollout_ref.ref.megatron.expert_model_parallel_size": "no MoE model, so no expert parallelism",
        **{f"actor_rollout_ref.model.mtp.{k}": "multi-token prediction is not built"
           for k in ("enable", "enable_train", "enable_rollout")},
    },
    "run_qwen3-0.6b_gsm8k_grpo_tool.sh": {},
    "agent_loop_tutorial_tool_agent_cell.txt": {},
}


def _flat(node: object, prefix: str = "") -> list[str]:
    """The dotted leaf keys of a YAML mapping (an empty mapping is a leaf)."""
    if isinstance(node, dict) and node:
        return [k for key, value in node.items() for k in _flat(value, f"{prefix}{key}.")]
    return [prefix[:-1]]


def verl_keys() -> list[str]:
    """Every key of verl v0.9's generated Megatron trainer config, then those its fully-async config adds."""
    keys = _flat(yaml.safe_load((V0_9 / "_generated_ppo_megatron_trainer.yaml").read_text()))
    fully_async = yaml.safe_load((V0_9 / "fully_async_ppo_megatron_trainer.yaml").read_text())
    extra = _flat({k: v for k, v in fully_async.items() if k not in ("hydra", "defaults")})
    return keys + [k for k in extra if k not in keys]


def test_every_verl_v0_9_key_is_a_polyturn_key_or_classified():
    """Contract: each of verl v0.9's ~930 trainer keys is a polyturn key, a field of a polyturn mapping, or has a rule
    (honoured, renamed, same_as, composed, warned or refused): none reaches "unknown config key"."""
    keys = verl_keys()
    assert len(keys) > 900 and "actor_rollout_ref.actor.megatron.use_mbridge" in keys
    free = dict_keys(PPOConfig)
    loose = [k for k in keys if k not in KNOWN and not any(k.startswith(d + ".") for d in free)
             and launch._rule(k, VERL_KEYS) is None]
    assert not loose, f"{len(loose)} verl v0.9 keys are neither polyturn keys nor in recipe.verl_keys: {loose}"
    assert launch._rule("actor_rollout_ref.actor.unknown_thing", VERL_KEYS) is None  # the walk can fail


def _config_tokens(text: str) -> list[str]:
    """The dotted config keys a reason names (those starting with a polyturn section), `.*` dropped."""
    return [t.removesuffix(".*") for t in re.findall(r"\b[a-z_]+(?:\.[a-z_0-9]+)+(?:\.\*)?", text)
            if t.split(".", 1)[0] in TOP]


def test_every_reason_names_real_keys_and_every_refusal_a_fix():
    """Contract: a renamed or same_as key lands on a polyturn key; every key a reason names is a polyturn key or
    section, or a verl key the table classifies; every refusal says what to do (drop, set, give, use, put, rename,
    edit, export, cut, or a polyturn key)."""
    fixes = re.compile(r"\b(drop|set|give|use|put|rename|edit|export|cut)\b")
    bad = []
    for key, rule in VERL_KEYS.items():
        for target in (rule.rename, rule.same_as):
            if target is not None and target not in KNOWN:
                bad.append(f"{key}: {target} is not a polyturn key")
        named = _config_tokens(rule.why)
        bad += [f"{key}: names {t}" for t in named
                if t not in KNOWN and t not in SECTIONS and launch._rule(t, VERL_KEYS) is None]
        refusal = not (rule.warn or rule.rename or rule.same_as or rule.composed or rule.accept is None)
        if refusal and not (fixes.search(rule.why) or any(t in KNOWN or t in SECTIONS for t in named)):
            bad.append(f"{key}: its refusal names no fix: {rule.why}")
    assert not bad, bad
    assert _config_tokens("see actor_rollout_ref.actor.no_such_key.*") == ["actor_rollout_ref.actor.no_such_key"]


@pytest.mark.parametrize(("key", "expected"), [
    # the wrong suggestions, asked of the schema alone: nothing rather than a wrong key
    ("actor_rollout_ref.actor.megatron.use_mbridge", None),
    ("actor_rollout_ref.actor.megatron.expert_model_parallel_size", None),
    ("actor_rollout_ref.actor.checkpoint.async_save", None),
    ("actor_rollout_ref.nccl_timeout", None),
    ("actor_rollout_ref.rollout.calculate_log_probs", None),
    # typos: the key meant
    ("actor_rollout_ref.actor.ppo_mini_batchsize", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.rollout.temprature", "actor_rollout_ref.rollout.temperature"),
    ("trainr.total_epochs", "trainer.total_epochs"),
    ("actor_rollout_ref.actr.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),
])
def test_suggestion_names_the_counterpart_or_nothing(key, expected):
    """Contract: "did you mean" names a near spelling in the same section, or the same name in a near-spelled
    section, and nothing else (no `tensor_model_parallel_size` for `expert_model_parallel_size`)."""
    assert launch.suggest(key, KNOWN) == expected


def test_classified_keys_get_their_reason_not_a_suggestion():
    """Contract: the issue's keys with a wrong suggestion now get their own line: nccl_timeout becomes
    trainer.collective_timeout_s, calculate_log_probs=True is taken, use_mbridge is warned, expert parallelism and
    async checkpoint saving are refused or warned with the reason."""
    plan = launch.prepare(["actor_rollout_ref.nccl_timeout=9600", "actor_rollout_ref.rollout.calculate_log_probs=True",
                           "actor_rollout_ref.actor.megatron.use_mbridge=True",
                           "actor_rollout_ref.actor.checkpoint.async_save=True"])
    assert "trainer.collective_timeout_s=9600" in plan.overrides
    assert [w.split(" ")[0] for w in plan.warned] == ["actor_rollout_ref.actor.megatron.use_mbridge",
                                                      "actor_rollout_ref.actor.checkpoint.async_save=True"]
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.megatron.expert_model_parallel_size=4: expert "
                                          r"parallelism is not built"):
        launch.prepare(["actor_rollout_ref.actor.megatron.expert_model_parallel_size=4"])


def sh_line(name: str, home: Path) -> list[str]:
    """The arguments a verl .sh line passes to its `python -m`, as bash expands them with HOME=`home` (a copy of the
    script runs, so nothing is written beside the original)."""
    text = re.sub(r"^python3? -m \S+", "printf '%s\\n'", (V0_9 / name).read_text(), flags=re.M)
    script = home / name
    script.write_text(text)
    out = subprocess.run(["bash", str(script)], env={"HOME": str(home), "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [a for a in out.splitlines() if a and not a.startswith("--config-path")]


def cell_line(home: Path) -> list[str]:
    """The overrides of verl's agent-loop tutorial's tool_agent training cell, its Python names filled in."""
    names = {"train_file": f"{home}/data/gsm8k/train.parquet", "test_file": f"{home}/data/gsm8k/test.parquet",
             "model_path": f"{home}/models/Qwen3-1.7B", "rollout_name": "sglang", "os": os,
             "tool_config_path": f"{home}/gsm8k_tool_config.yaml"}
    tree = ast.parse((V0_9 / "agent_loop_tutorial_tool_agent_cell.txt").read_text())
    (overrides,) = [k.value for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "overrides"]
    return [eval(compile(ast.Expression(e), "cell", "eval"), names) for e in overrides.elts]  # noqa: S307


def classify(args: list[str]) -> dict[str, list[str]]:
    """Each argument alone through `launch.prepare`: honoured, warned (dropped, in the warning) or refused."""
    out: dict[str, list[str]] = {"honoured": [], "warned": [], "refused": []}
    flags = [a for a in args if a.startswith("-")]
    for arg in args:
        if arg.startswith("-"):
            continue
        try:
            plan = launch.prepare([*flags, arg])
        except ConfigError:
            out["refused"].append(arg)
            continue
        mine = [w for w in plan.warned if w.startswith(arg.split("=", 1)[0].lstrip("+"))]
        out["warned" if mine else "honoured"].append(arg)
    return out


@pytest.mark.parametrize("name", list(NOT_BUILT))
def test_verl_v0_9_lines_pass_prepare(name, tmp_path, capsys):
    """Contract: verl v0.9's fully-async Megatron line, verl-recipe's GSM8K tool line and the agent-loop tutorial's
    tool_agent cell pass `launch.prepare` (before Hydra and Ray) once the keys in NOT_BUILT are dropped, and those
    are refused with a reason; every other key is honoured or warned. The fully-async line composes to
    async_training.schedule=fully_async with verl's batch keys mapped."""
    args = cell_line(tmp_path) if name.endswith(".txt") else sh_line(name, tmp_path)
    counts = classify(args)
    refused = {a.split("=", 1)[0].lstrip("+"): a for a in counts["refused"]}
    assert set(refused) == set(NOT_BUILT[name]), sorted(refused)
    with capsys.disabled():
        print(f"\n{name}: {len(args)} arguments; " + ", ".join(f"{k} {len(v)}" for k, v in counts.items()))
    if refused:
        with pytest.raises(ConfigError) as err:
            launch.prepare(args)
        message = str(err.value)
        assert all(f"{arg.lstrip('+')}: " in message for arg in refused.values()) and "unknown config key" not in message
    plan = launch.prepare([a for a in args if a not in refused.values()])
    if name.startswith("grpo_qwen35"):
        assert plan.config_name == launch.FULLY_ASYNC_PRESET
        config = launch.compose(plan)
        assert config["async_training"]["schedule"] == "fully_async"
        assert launch.fully_async_overrides(plan, config) == ["data.train_batch_size=16",
                                                              f"trainer.total_training_steps={64 * 32 * 10 // 16}"]
