"""Config trees of dataclasses <-> plain dicts: the generic builder, the defaults, the key lists, Hydra's schema node.

`build(cls, d)` turns a plain nested dict (Hydra's composed config) into dataclass tree `cls`,
each section built by its own `__post_init__` checks; an unknown key anywhere is refused naming
its full dotted path (with "did you mean"), a scalar of the wrong type naming its key. Sibling
sections are checked independently and every refusal is raised together (`Problems`); a section's
own checks are skipped when one of its fields was refused. `defaults`,
`flat_keys` and `dict_keys` read a tree's declarations without building it; `register_schema`
hands the defaults to Hydra. The declarations themselves live in `recipe.config_schema` (RL) and
`recipe.sft_config` (SFT).
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any


class ConfigError(ValueError):
    """A config value is missing, unknown or inconsistent; each problem names the key and the fix. Problems found
    together travel in one error (`problems`), printed one line each."""

    def __init__(self, *problems: str) -> None:
        super().__init__(*problems)
        self.problems = [" ".join(str(p).split()) for p in problems]

    def __str__(self) -> str:
        return "\n".join(self.problems)


def problem_lines(err: BaseException) -> list[str]:
    """The lines an error prints: one per problem of a ConfigError, else its message on one line."""
    if isinstance(err, ConfigError):
        return err.problems
    return [" ".join(str(err).split()) or type(err).__name__]


class Problems:
    """Launch problems collected, so that one run reports every one it can find: `check` runs an independent check
    and records its refusal (an error of a `catch` type); a check that needs an earlier one's result is skipped when
    that one failed (the caller sees its None); `raise_all` raises the lines as one ConfigError."""

    def __init__(self, catch: tuple[type[BaseException], ...] = (ConfigError,)) -> None:
        self.lines: list[str] = []
        self.catch = catch

    def add(self, err: BaseException) -> None:
        """Record `err`'s lines (each once)."""
        self.lines += [line for line in problem_lines(err) if line not in self.lines]

    def check(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, or None when it refused (its lines recorded)."""
        try:
            return fn(*args, **kwargs)
        except self.catch as err:
            self.add(err)
            return None

    def raise_all(self) -> None:
        """Raise every line recorded as one ConfigError; nothing when none was."""
        if self.lines:
            raise ConfigError(*self.lines)


def build(cls: type, d: dict[str, Any]) -> Any:
    """Dataclass tree `cls` built and validated from a plain nested dict (`OmegaConf.to_container(cfg,
    resolve=True)`; Hydra's own `hydra` node is dropped). Raises ConfigError naming the key."""
    return _build(cls, {k: v for k, v in d.items() if k != "hydra"}, "")


def section_type(hint: Any) -> type | None:
    """The dataclass a field holds (`X` or `X | None`), or None for a leaf."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    classes = [o for o in options if dataclasses.is_dataclass(o)]
    return classes[0] if classes else None


def _build(cls: type, d: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from mapping `d` (keys under `prefix`), recursing into dataclass-typed fields."""
    where = prefix.rstrip(".") or "the config root"
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__} {d!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    problems = Problems()
    unknown = sorted(set(d) - names)
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(names), n=1)
        problems.add(ConfigError(f"unknown config key(s) {[prefix + k for k in unknown]}" +
                                 (f"; did you mean {prefix + near[0]}?" if near else f"; {where} has {sorted(names)}")))
    kwargs = {}
    for key, value in d.items():  # every section and field checked, each on its own
        if key in unknown:
            continue
        section = section_type(hints[key])
        if section is not None and value is not None:
            kwargs[key] = problems.check(_build, section, value, f"{prefix}{key}.")
        else:
            kwargs[key] = problems.check(_check_type, value, hints[key], prefix + key)
    problems.raise_all()  # the checks of `cls` itself read its fields: skipped when one of them failed
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:  # the section's own check: name the section unless the message does
        message = str(err)
        raise ConfigError(message if message.startswith(where) else f"{where}.{message}") from err


_SCALARS = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}


def _check_type(value: Any, hint: Any, key: str) -> Any:
    """Refuse a scalar of the wrong type (e.g. a string where a number belongs); ints pass as floats."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} is null; it needs a value of type {hint}")
    for option in options:
        accepted = _SCALARS.get(option)
        if accepted is None:
            return value  # lists and other containers: the dataclass checks them
        if isinstance(value, accepted) and not (option is not bool and isinstance(value, bool)):
            return float(value) if option is float else value
    raise ConfigError(f"{key}={value!r} has type {type(value).__name__}; it must be {hint}")


def defaults(cls: type) -> dict[str, Any]:
    """Every default of the config tree as a nested dict, read from the dataclass fields (no instance is built, so
    no validation runs): the base Hydra node that `ppo_trainer.yaml` and the presets override."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        section = section_type(hints[f.name])
        if section is not None and f.default_factory is section:
            out[f.name] = defaults(section)
        elif section is not None:  # a section whose default is a configured instance (the critic's optimizer)
            out[f.name] = dataclasses.asdict(f.default_factory())
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory()
    return out


def register_schema(name: str, cls: type) -> None:
    """Register the defaults of config tree `cls` with Hydra's ConfigStore as `name`, the first entry of its YAML's
    defaults list (`ppo_trainer.yaml`: `ppo_trainer_schema`), so a preset holds only what it changes. Whoever
    composes a preset calls it first (`recipe.launch.compose`); registering again replaces the node."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=defaults(cls))


def leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, type]]:
    """(dotted key, type hint, the section dataclass declaring it) of every leaf field, sections walked into."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = section_type(hints[f.name])
        if section is not None:
            yield from leaves(section, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, hints[f.name], cls


def dict_keys(cls: type) -> list[str]:
    """The dotted keys of free-form mapping fields (`reward_kwargs`, `override_transformer_config`): any key under
    them is accepted as it is."""
    return [key for key, hint, _ in leaves(cls) if hint is dict or typing.get_origin(hint) is dict]


def flat_keys(cls: type) -> list[str]:
    """Every dotted leaf key the config accepts (the public config surface)."""
    return sorted(key for key, _, _ in leaves(cls))

