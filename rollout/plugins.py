"""One loader for every plug-in (tools, interactions, scorers, reward functions), and the rollout's plug-in YAML.

`import_object` loads a dotted path (`package.module.Name`) or verl's file form (`path/to/file.py:name`,
verl's `custom_reward_function.{path,name}`); tools and interactions come from YAML in verl's formats:

    tools:                                   # tool config (multi_turn.tool_config_path)
      - class_name: pkg.module.MyTool        # dotted path; any class with verl's tool methods
        config: {type: native, timeout_s: 10}
        tool_schema: {type: function, function: {name, description, parameters}}  # or the class's own
      - class_name: rollout.tools.mcp_tool.MCPTool
        config: {type: mcp}
        mcp: {mcp_servers_config_path: servers.json, tool_selected_list: [search]}

    interaction:                             # interaction config (multi_turn.interaction_config_path)
      - name: gsm8k                          # optional: verl's default is the class name without
        class_name: pkg.module.MyInteraction #   its "Interaction" suffix, lower-cased
        config: {max_user_turns: 3}

Classes are taken as verl users write them: duck-typed (subclassing polyturn's `BaseTool` /
`BaseInteraction` is optional), built as `cls(config=..., tool_schema=...)` /
`cls(config=...)` with the entry's name injected into an interaction's config, and called with
verl's signatures. Methods whose signature takes fewer arguments than polyturn offers
(verl's base `calculate_score(self)`, `finalize_interaction(self)`) are called with what they
accept (`call_accepting`). A sample selects plug-ins by its `tools_kwargs` keys and its
`interaction_kwargs.name`.

`Registry` and `PluginRunner` are the lifecycle both kinds share: one runner per plug-in, a
timeout on every call, open/close counted, close guaranteed by `session()` (also on
cancellation). `rollout.tools` and `rollout.interactions` add only what differs (tool limits
and response shapes; interaction turns).

verl's class paths for what the rollout ships resolve through ONE table, `VERL_ALIASES` (so
verl's YAML loads unchanged, verl installed or not); whoever loads a YAML may add aliases of its own
for the loading (`Registry.from_config(..., aliases=)`: the recipe's tasks map verl's scorers onto
theirs); any other `verl.*` path imports from verl when it is installed, and otherwise fails naming
the table.

A user's plug-in module is imported as verl would import it: without verl installed, its
`from verl.tools.base_tool import BaseTool, ToolResponse` (and the other modules of the aliases in effect) gets
polyturn's counterparts (`VerlStandIns`, `prepare_user_imports`); and a dotted path whose top-level package is
already imported from elsewhere is also looked up in the same-named directories on sys.path
(`_import_module`): verl-recipe's `recipe.<name>....` (its checkout on sys.path) imports from the user's path
although polyturn's own top-level package is also `recipe`, whose modules keep precedence.

Tool methods get their `tools_kwargs` in the shape their signature asks for, read once at load
(`kwargs_shape`): a method with `**kwargs` gets both the keys flat and the same dict under
`create_kwargs=` / `execute_kwargs=` / `calc_reward_kwargs=` / `release_kwargs=` (verl's tools
read either); otherwise the nested dict when it names that parameter, else the keys flat.

Departs from verl: every mistake in a config is refused at load, naming the entry and the fix
(verl fails at the first call); plug-in failures and timeouts are data, never exceptions.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.abc
import importlib.util
import inspect
import logging
import pkgutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml

logger = logging.getLogger(__name__)


class PluginConfigError(ValueError):
    """A plug-in YAML entry, or a sample's plug-in selection, is wrong; the message names it and the fix."""


# verl's dotted paths -> polyturn's counterparts (used whether or not verl is installed).
VERL_ALIASES: dict[str, str] = {
    "verl.tools.base_tool.BaseTool": "rollout.tools.base.BaseTool",
    # verl's base_tool imports these two from its schemas; tools import them from either module
    "verl.tools.base_tool.OpenAIFunctionToolSchema": "rollout.tools.schemas.OpenAIFunctionToolSchema",
    "verl.tools.base_tool.ToolResponse": "rollout.tools.schemas.ToolResponse",
    "verl.tools.gsm8k_tool.Gsm8kTool": "rollout.tools.gsm8k_tool.Gsm8kTool",
    # verl's remote code sandbox -> the local sandbox, verl's config keys translated
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "rollout.tools.sandbox_fusion.SandboxFusionTool",
    # MCP tools: one tool per server tool; results are the server's text (no search-result reformatting)
    "verl.tools.mcp_base_tool.MCPBaseTool": "rollout.tools.mcp_tool.MCPTool",
    "verl.tools.mcp_search_tool.MCPSearchTool": "rollout.tools.mcp_tool.MCPTool",
    **{f"verl.tools.schemas.{name}": f"rollout.tools.schemas.{name}" for name in (
        "OpenAIFunctionPropertySchema", "OpenAIFunctionParametersSchema", "OpenAIFunctionSchema",
        "OpenAIFunctionToolSchema", "OpenAIFunctionParsedSchema", "OpenAIFunctionCallSchema",
        "OpenAIFunctionToolCall", "ToolResponse")},
    "verl.interactions.base.BaseInteraction": "rollout.interactions.base.BaseInteraction",
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "rollout.interactions.gsm8k.Gsm8kInteraction",
    "verl.utils.rollout_trace.rollout_trace_op": "rollout.tracing.rollout_trace_op",
    # function tools (multi_turn.function_tool_path): verl's decorator, marking the function for polyturn's loader
    "verl.tools.function_tool.function_tool": "rollout.tools.function_tool.function_tool",
}

# The scorer verl's gsm8k tool and interaction use (verl's own path): theirs when their config names no
# `score_fn` (verl's `config: {type: native}` / `config: {}`); whoever loads the YAML maps it (`aliases`).
VERL_GSM8K_SCORE_FN = "verl.utils.reward_score.gsm8k.compute_score"

# Aliases added by the caller for the duration of one load (`added_aliases`), on top of VERL_ALIASES.
_ADDED_ALIASES: ContextVar[Mapping[str, str]] = ContextVar("added_aliases", default={})


@contextmanager
def added_aliases(aliases: Mapping[str, str] | None) -> Iterator[None]:
    """Within the block, `import_object` also resolves `aliases` (verl path -> polyturn path)."""
    token = _ADDED_ALIASES.set({**_ADDED_ALIASES.get(), **(aliases or {})})
    try:
        yield
    finally:
        _ADDED_ALIASES.reset(token)


def _aliases() -> dict[str, str]:
    """The aliases in effect: VERL_ALIASES and those added for the current load."""
    return {**VERL_ALIASES, **_ADDED_ALIASES.get()}


class VerlStandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """verl's plug-in modules when verl is not installed: each `verl.<module>` of the aliases in effect
    (`verl.tools.base_tool`, `verl.tools.schemas`, `verl.interactions.base`, `verl.utils.rollout_trace`, ...) is a
    module holding polyturn's counterparts under verl's names; their parent packages are empty.

    Last on `sys.meta_path`, so a real verl on the path is found first; once a `verl` that is not this stand-in is
    imported, it serves nothing (a real verl's missing modules stay missing)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "verl" and getattr(sys.modules.get("verl"), "__loader__", None) is not self:
            return None
        modules = _verl_modules()
        packages = {m.rsplit(".", depth)[0] for m in modules for depth in range(1, m.count(".") + 1)}
        if fullname not in modules and fullname not in packages:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname in packages)

    def exec_module(self, module: Any) -> None:
        for attr, ours in _verl_modules().get(module.__name__, {}).items():
            setattr(module, attr, import_object(ours, f"polyturn's stand-in for {module.__name__}"))


def _verl_modules() -> dict[str, dict[str, str]]:
    """verl module -> {name in it: polyturn's dotted path}, from the aliases in effect."""
    modules: dict[str, dict[str, str]] = {}
    for verl_path, ours in _aliases().items():
        module, _, attr = verl_path.rpartition(".")
        if module.startswith("verl."):
            modules.setdefault(module, {})[attr] = ours
    return modules


_VERL_STAND_INS = VerlStandIns()


def prepare_user_imports() -> None:
    """Make verl's plug-in modules importable without verl, as `VerlStandIns` (last on sys.meta_path, so a real
    verl wins; idempotent)."""
    if _VERL_STAND_INS not in sys.meta_path:
        sys.meta_path.append(_VERL_STAND_INS)


def _import_module(name: str) -> Any:
    """`importlib.import_module(name)`; when a submodule is missing from an already imported top-level package
    (verl-recipe's `recipe.<name>` vs polyturn's `recipe`), that package's path is extended once with the
    same-named directories on sys.path now (`pkgutil.extend_path`, its own directory first) and the import tried
    again."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = sys.modules.get(name.partition(".")[0])
        path = getattr(top, "__path__", None)
        if top is None or path is None or not (exc.name or "").startswith(top.__name__ + "."):
            raise
        extended = pkgutil.extend_path(list(path), top.__name__)
        if extended == list(path):
            raise
        top.__path__ = extended
        return importlib.import_module(name)


def _verl_installed() -> bool:
    """Whether a real verl is importable (polyturn's stand-ins are not verl)."""
    spec = importlib.util.find_spec("verl")
    return spec is not None and spec.loader is not _VERL_STAND_INS


def import_object(dotted: Any, where: str) -> Any:
    """Import `package.module.Name` (verl's paths through `VERL_ALIASES` and the added aliases), or `Name` from a
    Python file given as `path/to/file.py:Name`; errors name `where` (e.g. `tools.yaml: tools[2].class_name`)."""
    prepare_user_imports()
    if isinstance(dotted, str) and dotted.rpartition(":")[0].endswith(".py"):
        return _import_from_file(*dotted.rsplit(":", 1), where)
    if not isinstance(dotted, str) or "." not in dotted:
        raise PluginConfigError(f"{where}: expected a dotted path like 'package.module.Name', got {dotted!r}")
    aliases = _aliases()
    if dotted in aliases:
        logger.debug("%s: %s resolves to polyturn's %s", where, dotted, aliases[dotted])
        dotted = aliases[dotted]
    elif dotted.startswith("verl.") and not _verl_installed():
        raise PluginConfigError(
            f"{where}: {dotted} is a verl path with no polyturn counterpart and verl is not installed. "
            f"polyturn's counterparts of verl's paths (rollout.plugins.VERL_ALIASES and the recipe's tasks): "
            f"{sorted(aliases)}; use one of those, your own, or install verl")
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = _import_module(module_name)
    except ImportError as exc:
        raise PluginConfigError(
            f"{where}: cannot import module {module_name!r} ({exc}); check the path and that it is installed"
        ) from exc
    if not hasattr(module, attr):
        raise PluginConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}; check the name")
    return getattr(module, attr)


def _import_from_file(path: str, attr: str, where: str) -> Any:
    """`attr` of the Python file at `path` (verl's `custom_reward_function.{path,name}` form), run as a module."""
    spec = importlib.util.spec_from_file_location(f"plugin_file_{Path(path).stem}", path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise PluginConfigError(f"{where}: {path!r} is not a Python file; point the path at a .py file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, attr):
        raise PluginConfigError(f"{where}: {path} defines no {attr!r}; name a function or class that file defines")
    return getattr(module, attr)


def import_class(dotted: Any, where: str, required: tuple[str, ...]) -> type:
    """Import a plug-in class and check it has the `required` methods (duck typing, no base class)."""
    cls = import_object(dotted, where)
    if not isinstance(cls, type):
        raise PluginConfigError(f"{where}: {dotted} is not a class")
    missing = [m for m in required if not callable(getattr(cls, m, None))]
    if missing:
        raise PluginConfigError(f"{where}: {dotted} lacks {missing}; implement verl's plug-in methods {list(required)}")
    return cls


def read_entries(source: str | Path | dict[str, Any], key: str) -> tuple[list[dict[str, Any]], str, Path | None]:
    """The mapping entries under `key` of a YAML file (or loaded mapping), a label for errors, the file's dir."""
    if isinstance(source, dict):
        data, label, base = source, "<config>", None
    else:
        path = Path(source)
        if not path.is_file():
            raise PluginConfigError(f"config file {path} does not exist; pass a YAML file with a '{key}:' list")
        try:
            data, label, base = yaml.safe_load(path.read_text()) or {}, str(path), path.parent
        except yaml.YAMLError as err:  # name the file: PyYAML says only "<unicode string>"
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise PluginConfigError(f"{path}:{where} is not valid YAML ({getattr(err, 'problem', None) or err}); "
                                    "fix the file") from err
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise PluginConfigError(f"{label}: expected a top-level '{key}:' list")
    for i, entry in enumerate(data[key]):
        if not isinstance(entry, dict):
            raise PluginConfigError(f"{label}: {key}[{i}]: expected a mapping, got {type(entry).__name__}")
        if not isinstance(entry.get("config") or {}, dict):
            raise PluginConfigError(f"{label}: {key}[{i}].config: expected a mapping")
    return data[key], label, base


def check_keys(entry: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(entry) - allowed
    if unknown:
        raise PluginConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")


def build(cls: type, where: str, **kwargs: Any) -> Any:
    """`cls(**kwargs)`; any failure is a PluginConfigError naming the entry."""
    try:
        return cls(**kwargs)
    except PluginConfigError:
        raise
    except Exception as exc:
        raise PluginConfigError(f"{where}: building {cls.__name__} failed: {type(exc).__name__}: {exc}") from exc


def check_runner(runner_cls: Callable[[Any], Any], plugin: Any, where: str) -> None:
    """Build a plug-in's runner once at load, so bad limits or schemas fail naming the entry."""
    try:
        runner_cls(plugin)
    except ValueError as exc:
        raise PluginConfigError(f"{where}: {exc}") from None


def verl_interaction_name(class_name: str) -> str:
    """verl's default interaction name: `pkg.Gsm8kInteraction` -> `gsm8k`, `pkg.Judge` -> `judge`."""
    simple = class_name.rsplit(".", 1)[-1]
    return (simple.removesuffix("Interaction") if simple.endswith("Interaction") else simple).lower()


def call_accepting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn` with the arguments its signature accepts: all of them, else without `kwargs`,
    else with nothing (verl's base `calculate_score(self)` and `finalize_interaction(self)`)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    for a, kw in ((args, kwargs), (args, {}), ((), {})):
        try:
            sig.bind(*a, **kw)
        except TypeError:
            continue
        return fn(*a, **kw)
    return fn(*args, **kwargs)  # raises the TypeError that names the mismatch


def kwargs_shape(fn: Callable[..., Any], fixed: tuple[str, ...], nested: str, where: str) -> str:
    """How `fn` takes a sample's kwargs for one call, read from its signature: "both" (it has `**kwargs`),
    "nested" (it names the `nested` parameter, e.g. `create_kwargs`) or "flat". PluginConfigError naming
    `where` when it cannot take the call's `fixed` arguments (e.g. `instance_id`) in any shape."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "both"
    params = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        shape = "both"
    elif nested in sig.parameters and sig.parameters[nested].kind is not inspect.Parameter.POSITIONAL_ONLY:
        shape = "nested"
    else:
        shape = "flat"
    try:
        sig.bind_partial(*fixed)  # the rest may come from the sample's kwargs
    except TypeError as exc:
        raise PluginConfigError(
            f"{where} cannot be called as verl calls it, with ({', '.join(fixed)}) and the sample's {nested} "
            f"flat or as {nested}=: {exc}; give it verl's signature ({', '.join(fixed)}, **kwargs)") from None
    return shape


def shaped_kwargs(shape: str, nested: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A sample's kwargs in the `shape` from `kwargs_shape`: flat, `{nested: kwargs}`, or both at once."""
    if shape == "flat":
        return dict(kwargs)
    if shape == "nested":
        return {nested: dict(kwargs)}
    return {**kwargs, nested: dict(kwargs)}


P = TypeVar("P")
R = TypeVar("R", bound="PluginRunner")


class PluginRunner(Generic[P]):
    """Runs one plug-in object: time-limited calls, counted open/close, close guaranteed."""

    kind = "plug-in"

    timeout_s: float  # seconds any one call may take; set by the subclass

    def __init__(self, plugin: P, name: str):
        self.plugin = plugin
        self.name = name
        self.num_opened = 0  # instances opened successfully (tool create / interaction start)
        self.num_closed = 0  # close calls made for opened instances, even if the close raised
        self.live_instances: set[str] = set()

    async def _timed(self, awaitable: Awaitable[Any]) -> Any:
        return await asyncio.wait_for(awaitable, self.timeout_s)

    async def _open(self, opened: Any) -> str:
        """Count an instance id returned by the plug-in's open call (awaited here, time-limited)."""
        iid = await self._timed(opened)
        if not isinstance(iid, str) or not iid:
            raise TypeError(f"{self.kind} {self.name!r}: opening an instance returned {iid!r}; return its id (str)")
        self.num_opened += 1
        self.live_instances.add(iid)
        return iid

    async def close(self, instance_id: str, method: str, **kwargs: Any) -> None:
        """Call the plug-in's `method` (release / finalize_interaction) once; errors are logged, never raised."""
        if instance_id not in self.live_instances:
            logger.warning("%s %r: %s of unknown or closed instance %r ignored", self.kind, self.name, method, instance_id)
            return
        self.live_instances.discard(instance_id)
        self.num_closed += 1
        try:
            await self._timed(call_accepting(getattr(self.plugin, method), instance_id, **kwargs))
        except Exception:  # noqa: BLE001 - closing must not end the trajectory
            logger.exception("%s %r: %s(%r) failed", self.kind, self.name, method, instance_id)

    @asynccontextmanager
    async def _session(self, opened: Callable[[], Awaitable[str]], method: str,
                       close_kwargs: dict[str, Any]) -> AsyncIterator[str]:
        iid = await opened()
        try:
            yield iid
        finally:
            # Shielded so a cancelled trajectory still closes; the close itself is time-limited.
            await asyncio.shield(self.close(iid, method, **close_kwargs))

    async def score(self, method: str, instance_id: str, **kwargs: Any) -> float:
        """`plugin.method(instance_id, **kwargs)` as a float; a failure or non-number gives 0.0, logged."""
        try:
            return float(await self._timed(call_accepting(getattr(self.plugin, method), instance_id, **kwargs)))
        except Exception:  # noqa: BLE001
            logger.exception("%s %r: %s(%r) failed or was not a number; using 0.0", self.kind, self.name, method,
                             instance_id)
            return 0.0


class Registry(Generic[R]):
    """The runners of one rollout's plug-ins of one kind, by name (unique).

    A kind sets `kind`, `runner_cls` (its runner) and `load` (YAML path or mapping -> plug-in objects).
    """

    kind = "plug-in"
    runner_cls: Callable[[Any], R]
    load: Callable[[str | Path | dict[str, Any]], list[Any]]

    def __init__(self, plugins: list[Any]):
        self.runners: dict[str, R] = {}
        for plugin in plugins:
            runner = self.runner_cls(plugin)
            if runner.name in self.runners:
                raise PluginConfigError(f"two {self.kind}s are named {runner.name!r}; names must be unique")
            self.runners[runner.name] = runner

    @classmethod
    def from_config(cls, source: str | Path | dict[str, Any] | None,
                    aliases: Mapping[str, str] | None = None) -> Registry[R]:
        """Registry from a YAML path or mapping (None: none of this kind); `aliases` (verl path -> polyturn path)
        resolve on top of VERL_ALIASES while it loads, for class paths and paths in a plug-in's config alike."""
        with added_aliases(aliases):
            return cls(cls.load(source) if source is not None else [])

    @property
    def names(self) -> list[str]:
        """Names of the registered plug-ins, in config order."""
        return list(self.runners)

    def runner(self, name: str) -> R:
        """The runner of `name`; KeyError naming the known ones otherwise."""
        if name not in self.runners:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {self.names}")
        return self.runners[name]

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per plug-in: (instances opened, instances closed)."""
        return {n: (r.num_opened, r.num_closed) for n, r in self.runners.items()}

    async def aclose(self) -> None:
        """Call every plug-in's optional `close()` (shared resources such as MCP connections)."""
        for runner in self.runners.values():
            close = getattr(runner.plugin, "close", None)
            if close is None:
                continue
            try:
                result = close()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001
                logger.exception("closing %s %r failed", self.kind, runner.name)
