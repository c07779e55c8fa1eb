"""The command line before Hydra: verl's launch lines as they are, and every launch mistake as one line.

`prepare(argv, entry)` reads an entry point's arguments (`PPO`: `python -m recipe.main_ppo`; `recipe.sft_config.SFT`:
`python -m recipe.main_sft`) the way Hydra will, and decides for each override, by the entry's verl key table
(`recipe.verl_keys.VERL_KEYS`) and its schema's keys:

- honoured: a polyturn key, or a verl key renamed onto its counterpart here
  (`rollout.log_prob_*` -> `actor.log_prob_*`, `actor.megatron.seed` -> `trainer.seed`), or a verl key
  whose value is what polyturn always does (`data.return_raw_chat=True`);
- mapped once composed: verl's fully async batch keys (`data.train_batch_size=0`, `async_training.require_batches`,
  `rollout.total_rollout_steps`) onto `data.train_batch_size` and `trainer.total_training_steps`
  (`fully_async_overrides`), refused unless `async_training.schedule=fully_async` (verl's fully_async_main's config
  name is the preset `fully_async_ppo_megatron_trainer`);
- warned: verl-internal tuning knobs with no counterpart here, or none that changes the result
  (profiler, wake-up staging, FSDP knobs ...), dropped, all listed in ONE
  start-up warning;
- refused: everything whose silent loss would change the result, and typos (with "did you
  mean"), keys given twice, `--config-path`: ALL refusals in one `ConfigError`, before Hydra.

`load(argv, entry)` then composes with Hydra's compose API and builds the entry's typed config, so Hydra's
own errors (its struct "use +key" advice among them) never reach the user; every mistake it finds (refused keys, and
the values of the config the other overrides compose) is raised in one `ConfigError`, which the entry point prints
a line each before it exits 2 (`HYDRA_FULL_ERROR=1` re-raises it, traceback included).
"""
from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipe.config_build import ConfigError, Problems, dict_keys, flat_keys, register_schema
from recipe.config_schema import PPOConfig
from recipe.verl_keys import VERL_BATCH, VERL_KEYS, Rule

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "config"
PRESETS = tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "sft_trainer"))  # the RL presets
# Hydra's flags that take a value in the next argument, and those that stand alone (passed through).
_FLAGS_WITH_VALUE = ("--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p")
_FLAGS = ("--multirun", "-m", "--resolve", "--info", "-i", "--help", "-h", "--hydra-help")


@dataclass(frozen=True)
class Entry:
    """An entry point's command line: its typed config, its presets and what verl's keys become there."""

    schema: type
    """The config tree (`PPOConfig`, `SFTConfig`): its keys are the entry's keys, its `from_dict` builds it."""
    default_preset: str
    """The config composed without `--config-name`."""
    presets: tuple[str, ...]
    """The `--config-name` choices (recipe/config/*.yaml)."""
    verl_keys: dict[str, Rule]
    """verl keys that are not keys of the schema, by dotted key or section."""
    module: str
    """`python -m <module>`, named in messages."""
    preset_hint: str = ""
    """Said after an unknown --config-name."""
    preset_aliases: tuple[tuple[str, str], ...] = ()
    """(verl's config name, the preset it runs as)."""

    @property
    def schema_node(self) -> str:
        """The Hydra node of the schema's defaults, first in the default preset's defaults list (`ppo_trainer_schema`)."""
        return f"{self.default_preset}_schema"


# verl's fully async trainer (fully_async_main, --config-name fully_async_ppo_megatron_trainer): its batch keys become
# polyturn's once the config is composed (`fully_async_overrides`).
FULLY_ASYNC_PRESET = "fully_async_ppo_megatron_trainer"
_ASYNC = "async_training.schedule"
_BYPASS = "algorithm.rollout_correction.bypass_mode"


PPO = Entry(PPOConfig, "ppo_trainer", PRESETS, VERL_KEYS, "recipe.main_ppo",
            preset_hint=" (verl's gsm8k_multiturn_grpo is the base ppo_trainer: drop --config-name and keep the "
                        "overrides)",
            preset_aliases=(("fully_async_ppo_trainer", FULLY_ASYNC_PRESET),))  # polyturn trains with Megatron
"""The RL entry point."""


def _rule(key: str, verl_keys: dict[str, Rule]) -> Rule | None:
    """The rule for `key`, or for the nearest section above it, or for its last name in any section (`*.<name>`)."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        rule = verl_keys.get(".".join(parts[:i]))
        if rule is not None:
            return rule
    return verl_keys.get(f"*.{parts[-1]}")


def _renamed(key: str, rule: Rule | None, verl_keys: dict[str, Rule]) -> str:
    """Where `key`'s value goes: its rule's rename (a key under a renamed section keeps its tail), else `key`."""
    if rule is None or not rule.rename:
        return key
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        if verl_keys.get(".".join(parts[:i])) is rule:
            return ".".join([rule.rename, *parts[i:]])
    return rule.rename


@dataclass
class Launch:
    """A command line, read: the preset, Hydra's own flags, the overrides Hydra gets, and what the verl keys became."""

    config_name: str = "ppo_trainer"
    """The preset (`--config-name`)."""
    hydra_flags: list[str] = field(default_factory=list)
    """Hydra's own flags, passed through (`--cfg job`, `-m` ...)."""
    overrides: list[str] = field(default_factory=list)
    """What Hydra composes: polyturn keys only."""
    warned: list[str] = field(default_factory=list)
    """verl keys dropped as having no effect here, each with why (the one start-up warning)."""
    same_as: list[tuple[str, Any, str, str]] = field(default_factory=list)
    """(verl key, its value, the polyturn key it must equal, why) checked on the composed config."""
    verl_batch: dict[str, Any] = field(default_factory=dict)
    """verl's fully-async batch keys given (`async_training.require_batches`, `rollout.total_rollout_steps`,
    `data.train_batch_size=0`), mapped onto polyturn's once composed (`fully_async_overrides`)."""

    def warning(self) -> str | None:
        """The one start-up line listing every verl key that has no effect here, or None."""
        if not self.warned:
            return None
        return f"{len(self.warned)} verl key(s) have no effect in polyturn and are ignored: " + "; ".join(self.warned)


def _flag_value(argv: list[str], i: int) -> tuple[str, str, int]:
    """(flag, value, next index) of a `--flag=value` or `--flag value` argument at i."""
    arg = argv[i]
    if "=" in arg:
        flag, value = arg.split("=", 1)
        return flag, value, i + 1
    if i + 1 >= len(argv):
        raise ConfigError(f"{arg} needs a value, e.g. {arg} cpu_tiny")
    return arg, argv[i + 1], i + 2


def _read_flags(argv: list[str], entry: Entry, launch: Launch, refused: list[str]) -> list[str]:
    """The command line's flags into `launch` (a refused one appended to `refused`); the key=value overrides left."""
    raw: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-") and arg.split("=", 1)[0] in ("--config-path", "-cp"):
            _, value, i = _flag_value(argv, i)
            refused.append(f"--config-path={value}: polyturn's configs live in recipe/config; drop --config-path and "
                           f"pick one with --config-name (one of {list(entry.presets)})")
        elif arg.startswith("-") and arg.split("=", 1)[0] in _FLAGS_WITH_VALUE:
            flag, value, i = _flag_value(argv, i)
            if flag in ("--config-name", "-cn"):
                value = dict(entry.preset_aliases).get(value.removesuffix(".yaml"), value.removesuffix(".yaml"))
                if value not in entry.presets:
                    refused.append(f"--config-name={value}: no such preset; use one of {list(entry.presets)}"
                                   + entry.preset_hint)
                launch.config_name = value
            else:
                launch.hydra_flags += [flag, value]
        elif arg.startswith("-"):
            if arg.split("=", 1)[0] not in _FLAGS:
                refused.append(f"{arg}: not a flag of python -m {entry.module}; give key=value overrides")
            launch.hydra_flags.append(arg)
            i += 1
        else:
            raw.append(arg)
            i += 1
    return raw


def prepare(argv: list[str], entry: Entry | None = None, *, collect: list[str] | None = None) -> Launch:
    """Read a command line of `entry` (default `PPO`): every refusal raised at once as one ConfigError (a line each),
    else the Launch; with `collect`, the refusals are appended to it instead and the Launch holds the rest."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    entry = entry or PPO
    launch, refused = Launch(config_name=entry.default_preset), []
    raw = _read_flags(argv, entry, launch, refused)

    known = set(flat_keys(entry.schema))
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k} | {k.split(".", 1)[0] for k in known}
    dicts = set(dict_keys(entry.schema))
    parser = OverridesParser.create()
    seen: dict[str, str] = {}
    for arg in raw:
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException as err:
            refused.append(f"{arg!r} is not a key=value override ({str(err).splitlines()[0]}); write key=value, "
                           "quoting values with spaces")
            continue
        key = override.key_or_group
        if key.startswith("hydra.") or key == "hydra":
            launch.overrides.append(arg)
            continue
        value = override.value()
        rule = None if key in known else _rule(key, entry.verl_keys)  # a polyturn key under a verl section is ours
        target = _renamed(key, rule, entry.verl_keys)
        if target in seen:
            refused.append(f"{target} is given twice ({seen[target]} and {arg}); keep one")
            continue
        seen[target] = arg
        if override.is_delete():
            refused.append(f"{arg}: keys cannot be deleted (every key has a default); drop {arg}")
        elif rule is not None and rule.composed or key == "data.train_batch_size" and value == 0 and _ASYNC in known:
            launch.verl_batch[key] = value
        elif rule is None:
            if key in known or key in sections:
                launch.overrides.append(_normalize(key, value, arg))
            elif any(key.startswith(d + ".") for d in dicts):  # a field of a free-form mapping (reward_kwargs ...)
                launch.overrides.append("++" + arg.lstrip("+"))
            else:
                near = suggest(key, known)
                keys_file = entry.schema.__module__.replace(".", "/") + ".py"
                refused.append(f"unknown config key {key}" + (f"; did you mean {near}?" if near else
                                                                f"; see {keys_file} for the keys"))
        elif rule.rename:
            launch.overrides.append(f"{'++' if target != rule.rename else ''}{target}={arg.split('=', 1)[1]}")
        elif rule.same_as is not None:
            launch.same_as.append((key, value, rule.same_as, rule.why))
        elif rule.accept is None or value in rule.accept:
            if rule.warn and rule.accept is None:
                launch.warned.append(f"{key} ({rule.why})")
        elif rule.warn:
            launch.warned.append(f"{key}={value} ({rule.why})")
        else:
            refused.append(f"{key}={value}: {rule.why}")
    if refused and collect is None:
        raise ConfigError(*refused)
    if collect is not None:
        collect += refused
    if launch.config_name == FULLY_ASYNC_PRESET and _BYPASS not in seen:
        launch.warned.append(f"{_BYPASS} (verl's fully-async config defaults it to True, the engine's log-probs as the "
                             "old ones; here the trainer recomputes them, verl's False)")
    return launch


def suggest(key: str, known: set[str]) -> str | None:
    """The key a mistyped `key` means, or None rather than a guess: a key of the same section whose last name is a
    near spelling of its own (difflib ratio >= 0.88, so `expert_model_parallel_size` is not taken for
    `tensor_model_parallel_size`), else the same last name in a near-spelled section (ratio >= 0.8)."""
    section, _, name = key.rpartition(".")
    same = difflib.get_close_matches(name, sorted({k.rpartition(".")[2] for k in known
                                                   if k.rpartition(".")[0] == section}), n=1, cutoff=0.88)
    if same:
        return f"{section}.{same[0]}" if section else same[0]
    moved = difflib.get_close_matches(section, sorted({k.rpartition(".")[0] for k in known
                                                       if k.rpartition(".")[2] == name}), n=1, cutoff=0.8)
    return f"{moved[0]}.{name}" if moved else None


def _normalize(key: str, value: Any, arg: str) -> str:
    """The override as Hydra should get it: `+` dropped (every key exists), verl's `trainer.logger=console` as a
    list."""
    if key == "trainer.logger" and isinstance(value, str):
        return f"trainer.logger=[{value}]"
    return arg.lstrip("+")


def check_same_as(launch: Launch, config: dict[str, Any]) -> None:
    """Refuse, all at once, the verl keys accepted only when they equal a polyturn key of the composed config."""
    refused = []
    for key, value, other, why in launch.same_as:
        node: Any = config
        for part in other.split("."):
            node = node[part]
        if value != node and not (isinstance(node, str) and str(value) and Path(str(value)).expanduser().resolve()
                                  == Path(node).expanduser().resolve()):
            refused.append(f"{key}={value}: {why} (it is {node!r})")
    if refused:
        raise ConfigError(*refused)


def compose(launch: Launch, entry: Entry | None = None) -> dict[str, Any]:
    """The composed, resolved config of a command line of `entry` (default `PPO`), its `same_as` keys checked
    (`check_same_as`)."""
    config = _compose(launch, entry or PPO)
    check_same_as(launch, config)
    return config


def _compose(launch: Launch, entry: Entry) -> dict[str, Any]:
    """The entry's schema registered with Hydra (`register_schema`), then Hydra's compose API: the resolved config,
    Hydra's errors as one ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_schema(entry.schema_node, entry.schema)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=launch.config_name, overrides=launch.overrides)
        config = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(str(err)) from err
    return {k: v for k, v in config.items() if k != "hydra"}


def fully_async_overrides(launch: Launch, config: dict[str, Any]) -> list[str]:
    """verl's fully-async batch keys as polyturn overrides, read against the composed config. verl's trainer steps on
    require_batches x ppo_mini_batch_size prompts (its data.train_batch_size must be 0; require_batches defaults to
    1): here that is data.train_batch_size. Its rollout.total_rollout_steps counts prompts: total_rollout_steps //
    that batch steps (trainer.total_training_steps). Refused outside fully_async, which alone would read them, and
    beside the polyturn key they set."""
    given = launch.verl_batch
    if not given:
        return []
    if (schedule := config["async_training"]["schedule"]) != "fully_async":
        raise ConfigError(f"{', '.join(f'{k}={v}' for k, v in given.items())}: verl's fully async trainer reads it, "
                          f"and async_training.schedule={schedule} would ignore it; set {_ASYNC}=fully_async (verl's "
                          f"fully_async_main: --config-name {FULLY_ASYNC_PRESET}), or drop the key")
    mine = {o.split("=", 1)[0] for o in launch.overrides}
    refused = [f"{theirs} sets {ours} here (verl's fully async trainer); keep one of the two" for theirs, ours in
               (("async_training.require_batches", "data.train_batch_size"),
                ("rollout.total_rollout_steps", "trainer.total_training_steps")) if theirs in given and ours in mine]
    for key in VERL_BATCH:
        if key in given and (not isinstance(given[key], int) or isinstance(given[key], bool) or given[key] < 1):
            refused.append(f"{key}={given[key]}: a whole number >= 1")
    if refused:
        raise ConfigError(*refused)
    out, batch = [], config["data"]["train_batch_size"]
    if "data.train_batch_size" in given or "async_training.require_batches" in given:
        mini = config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"]
        batch = given.get("async_training.require_batches", 1) * mini
        out.append(f"data.train_batch_size={batch}")
    if "rollout.total_rollout_steps" in given:
        if given["rollout.total_rollout_steps"] < batch:
            raise ConfigError(f"rollout.total_rollout_steps={given['rollout.total_rollout_steps']} prompts are fewer "
                              f"than one step's {batch} (data.train_batch_size); raise it")
        out.append(f"trainer.total_training_steps={given['rollout.total_rollout_steps'] // batch}")
    return out


def load(argv: list[str], entry: Entry | None = None) -> tuple[Any, dict[str, Any], Launch]:
    """A command line as the entry point (default `PPO`) reads it, before anything starts: the typed config, its
    plain dict, and the Launch (its one warning; its overrides carry verl's fully-async keys mapped). Raises one
    ConfigError with every mistake found, a line each: the refused keys, and the value checks of the config the
    other overrides compose (none when the preset itself is refused; verl's fully-async keys mapped only when
    valid)."""
    entry = entry or PPO
    refused: list[str] = []
    launch = prepare(argv, entry, collect=refused)
    if launch.config_name not in entry.presets:  # nothing to compose
        raise ConfigError(*refused)
    problems = Problems()
    config = problems.check(_compose, launch, entry)
    if config is not None:
        problems.check(check_same_as, launch, config)
        extra = problems.check(fully_async_overrides, launch, config)
        if extra:
            launch.overrides += extra
            config = problems.check(_compose, launch, entry)
    cfg = problems.check(entry.schema.from_dict, config) if config is not None else None
    if refused:
        raise ConfigError(*refused, *_not_about(problems.lines, _refused_keys(argv, launch)))
    problems.raise_all()
    return cfg, config, launch


def _refused_keys(argv: list[str], launch: Launch) -> set[str]:
    """The keys of `argv`'s key=value arguments that reached neither Hydra nor a verl mapping (refused ones)."""
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a and not a.startswith("-")}
    taken = {o.split("=", 1)[0].lstrip("+") for o in launch.overrides} | set(launch.verl_batch)
    return given - taken - {key for key, *_ in launch.same_as}


def _not_about(lines: list[str], keys: set[str]) -> list[str]:
    """`lines` less those naming one of `keys`: a value checked without the user's refused override of it is not the
    value the user meant (fixing the override decides it)."""
    named = [re.compile(rf"(?<![\w.]){re.escape(k)}(?![\w.])") for k in keys]
    return [line for line in lines if not any(n.search(line) for n in named)]

