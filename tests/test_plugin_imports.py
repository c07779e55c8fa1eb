"""A verl user's plug-in modules import as they are: verl-recipe's `recipe.<name>...` class paths from the user's
path (polyturn's own package is also `recipe`, and keeps precedence), verl's plug-in modules (`verl.tools.base_tool`,
`verl.tools.schemas`, `verl.interactions.base`, `verl.utils.rollout_trace`) as polyturn's counterparts when verl is
not installed and never over a real verl, and tool entries without `tool_schema` when the class provides one."""
from __future__ import annotations

import asyncio
import importlib
import importlib.machinery
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import recipe
from rollout.interactions.base import BaseInteraction
from rollout.interactions.registry import InteractionRegistry
from rollout.plugins import PluginConfigError, _verl_installed, import_object
from rollout.tools.base import BaseTool
from rollout.tools.registry import ToolRegistry
from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from rollout.tracing import rollout_trace_op, trace_into

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
TOOL_PATH = "recipe.partial_rollout.tools.gsm8k_tool.Gsm8kTool"

# A tool as verl-recipe writes it: verl's base classes, verl's trace decorator.
VERL_RECIPE_TOOL = '''
from verl.tools.base_tool import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from verl.tools.schemas import OpenAIFunctionToolSchema as SchemaFromSchemas
from verl.utils.rollout_trace import rollout_trace_op


class Gsm8kTool(BaseTool):
    """Checks an answer against the sample's ground truth."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._truth = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        self._truth[instance_id] = ground_truth
        return instance_id, response

    @rollout_trace_op
    async def execute(self, instance_id, parameters, **kwargs):
        right = str(parameters["answer"]) == self._truth[instance_id]
        return ToolResponse(text="right" if right else "wrong"), 0.0, {}
'''

VERL_INTERACTION = '''
from verl.interactions.base import BaseInteraction


class EchoInteraction(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "echo: " + messages[-1]["content"], 1.0, {}
'''

SCHEMA = {"type": "function", "function": {"name": "check", "description": "check an answer", "parameters": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}


def verl_recipe_checkout(root: Path) -> Path:
    """`root` laid out as verl's checkout with verl-recipe under `recipe/` (no top-level `__init__.py`, as
    verl-recipe ships), plus a decoy `recipe/trainer.py` that must never shadow polyturn's."""
    tools = root / "recipe" / "partial_rollout" / "tools"
    tools.mkdir(parents=True)
    (root / "recipe" / "partial_rollout" / "__init__.py").write_text("")
    (tools / "gsm8k_tool.py").write_text(VERL_RECIPE_TOOL)  # tools/ is a namespace package: no __init__.py
    (root / "recipe" / "trainer.py").write_text("raise RuntimeError('the decoy shadowed polyturn')\n")
    return root


@pytest.fixture(autouse=True)
def clean_imports(monkeypatch):
    """No `verl` (stand-in or fake) and no user `recipe.*` module leaks between tests; `recipe.__path__` restored."""
    def user_modules():
        return [m for m in sys.modules if m == "verl" or m.startswith(("verl.", "recipe.partial_rollout"))]

    assert importlib.util.find_spec("verl") is None or not _verl_installed(), "these tests need verl not installed"
    for name in user_modules():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(recipe, "__path__", list(recipe.__path__))
    yield
    for name in user_modules():
        sys.modules.pop(name, None)


def run_tool(registry: ToolRegistry, name: str, answer: str) -> tuple[str | None, list]:
    async def run():
        runner = registry.runner(name)
        async with runner.session({"ground_truth": "72"}) as iid:
            return (await runner.execute(iid, {"answer": answer})).text

    records: list = []
    with trace_into(records):
        text = asyncio.run(run())
    return text, records


def test_a_verl_recipe_tool_loads_from_the_users_path_and_runs_on_polyturns_bases(tmp_path, monkeypatch):
    """Contract: with verl's checkout on sys.path (added after polyturn's `recipe` was imported), a
    `recipe.<name>...` class path polyturn lacks imports from it, including a namespace subpackage; its
    `from verl.tools.base_tool import ...` / `verl.tools.schemas` / `verl.utils.rollout_trace` get polyturn's
    classes (verl not installed), and its `execute` runs through the tool runner, traced."""
    monkeypatch.syspath_prepend(str(verl_recipe_checkout(tmp_path)))
    cls = import_object(TOOL_PATH, "test")
    assert Path(sys.modules[cls.__module__].__file__).is_relative_to(tmp_path)
    assert issubclass(cls, BaseTool)
    module = sys.modules[cls.__module__]
    assert (module.OpenAIFunctionToolSchema, module.SchemaFromSchemas, module.ToolResponse, module.rollout_trace_op) \
        == (OpenAIFunctionToolSchema, OpenAIFunctionToolSchema, ToolResponse, rollout_trace_op)
    registry = ToolRegistry.from_config({"tools": [{"class_name": TOOL_PATH, "config": {"type": "native"},
                                                    "tool_schema": SCHEMA}]})
    text, records = run_tool(registry, "check", "72")
    assert text == "right" and [r["name"] for r in records] == ["Gsm8kTool.execute"]
    assert recipe.__path__[0] == str(REPO / "recipe")  # polyturn's own first
    spec = importlib.machinery.PathFinder.find_spec("recipe.trainer", recipe.__path__)
    assert spec.origin == str(REPO / "recipe" / "trainer.py")


def test_a_verl_recipe_tool_loads_through_pythonpath_in_a_fresh_process(tmp_path):
    """Contract: as users launch, verl's checkout on PYTHONPATH (ahead of polyturn's): the class path loads and
    runs through the registry, and polyturn's `recipe.trainer` still resolves to polyturn's."""
    script = textwrap.dedent(f"""
        import asyncio, importlib.machinery, recipe
        from rollout.tools.registry import ToolRegistry
        reg = ToolRegistry.from_config({{"tools": [{{"class_name": "{TOOL_PATH}", "tool_schema": {SCHEMA!r}}}]}})
        async def run():
            async with reg.runner("check").session({{"ground_truth": "72"}}) as iid:
                return (await reg.runner("check").execute(iid, {{"answer": "71"}})).text
        print(asyncio.run(run()))
        print(importlib.machinery.PathFinder.find_spec("recipe.trainer", recipe.__path__).origin)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(verl_recipe_checkout(tmp_path)), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["wrong", str(REPO / "recipe" / "trainer.py")]


def test_a_missing_recipe_module_keeps_the_loaders_message(tmp_path, monkeypatch):
    """Contract: a `recipe.` path found neither in polyturn nor on the user's path is refused naming the entry."""
    monkeypatch.syspath_prepend(str(verl_recipe_checkout(tmp_path)))
    with pytest.raises(PluginConfigError, match=r"tools\[0\]: cannot import module 'recipe\.no_such_recipe\.tools'"):
        import_object("recipe.no_such_recipe.tools.Tool", "tools[0]")


def test_verl_interaction_module_loads_on_polyturns_base(tmp_path, monkeypatch):
    """Contract: an interaction written with `from verl.interactions.base import BaseInteraction` loads and
    responds, on polyturn's BaseInteraction."""
    (tmp_path / "user_interactions.py").write_text(VERL_INTERACTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_interactions", raising=False)
    registry = InteractionRegistry.from_config(
        {"interaction": [{"class_name": "user_interactions.EchoInteraction"}]})
    runner = registry.runner("echo")
    assert isinstance(runner.plugin, BaseInteraction)

    async def run():
        async with runner.session() as iid:
            return await runner.respond(iid, [{"role": "assistant", "content": "hi"}])

    turn = asyncio.run(run())
    assert (turn.should_terminate, turn.score) == (True, 1.0) and turn.text == "echo: hi"


def test_the_stand_ins_step_aside_for_a_verl_on_the_path(tmp_path, monkeypatch):
    """Contract: with a `verl` package on the path (here a fake one), verl's modules are its own, one it lacks
    stays missing (no stand-in mixed in), and an unknown verl path is tried in verl, not refused as uninstalled."""
    base = tmp_path / "verl" / "tools"
    base.mkdir(parents=True)
    for init in (tmp_path / "verl" / "__init__.py", base / "__init__.py"):
        init.write_text("")
    (base / "base_tool.py").write_text("class BaseTool:\n    FAKE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_object("rollout.tools.base.BaseTool", "test")  # the loader has run: stand-ins installed
    assert importlib.import_module("verl.tools.base_tool").BaseTool.FAKE
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("verl.interactions.base")
    assert _verl_installed()
    with pytest.raises(PluginConfigError, match=r"cannot import module 'verl\.tools\.geo3k_tool'"):
        import_object("verl.tools.geo3k_tool.Geo3kTool", "test")


def test_a_loads_added_aliases_are_importable_modules_too(tmp_path, monkeypatch):
    """Contract: verl's own gsm8k tool imports its scorer as `from verl.utils.reward_score import gsm8k`; loaded
    with the recipe's aliases (as main_ppo loads), that module holds the GSM8K task's scorer."""
    from recipe.tasks import gsm8k, verl_aliases

    (tmp_path / "scoring_tool.py").write_text(VERL_RECIPE_TOOL.replace(
        "from verl.tools.schemas", "from verl.utils.reward_score import gsm8k\nfrom verl.tools.schemas"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "scoring_tool", raising=False)
    ToolRegistry.from_config({"tools": [{"class_name": "scoring_tool.Gsm8kTool", "tool_schema": SCHEMA}]},
                             aliases=verl_aliases())
    assert sys.modules["scoring_tool"].gsm8k.compute_score is gsm8k.compute_score


# ---------------------------------------------------------------- tool_schema from the class


OWN_SCHEMA_TOOLS = '''
from rollout.tools.schemas import OpenAIFunctionToolSchema
from verl.tools.base_tool import BaseTool
from tests.verl_files.verl_copy.tools.base_tool import BaseTool as VerlCopyBaseTool

SCHEMA = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
    "name": "own", "description": "d", "parameters": {"type": "object", "properties": {}, "required": []}}})


class GetterTool(BaseTool):
    def get_openai_tool_schema(self):
        return SCHEMA

    async def execute(self, instance_id, parameters, **kwargs):
        return "ok", 0.0, {}


class AttributeTool(GetterTool):
    tool_schema = SCHEMA
    get_openai_tool_schema = BaseTool.get_openai_tool_schema


class OnVerlsOwnBase(VerlCopyBaseTool):
    def get_openai_tool_schema(self):
        return SCHEMA


class DuckTool:
    def __init__(self, config, tool_schema):
        self.tool_schema = tool_schema

    async def create(self, instance_id=None, **kwargs): return instance_id or "1", None
    async def execute(self, instance_id, parameters, **kwargs): return "ok", 0.0, {}
    async def calc_reward(self, instance_id, **kwargs): return 0.0
    async def release(self, instance_id, **kwargs): pass


class NoSchemaTool(BaseTool):
    pass
'''


@pytest.fixture
def own_schema_tools(tmp_path, monkeypatch):
    """`own_schema_tools`: tools that give their own schema (verl's ways) and two that give none."""
    (tmp_path / "own_schema_tools.py").write_text(OWN_SCHEMA_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "own_schema_tools", raising=False)


@pytest.mark.usefixtures("own_schema_tools")
@pytest.mark.parametrize("cls", ["GetterTool", "AttributeTool", "OnVerlsOwnBase"])
def test_an_entry_without_tool_schema_takes_the_classs(cls):
    """Contract: as in verl, an entry may leave `tool_schema` out when the class provides it (its
    `get_openai_tool_schema()`, a `tool_schema` class attribute; also on verl's own BaseTool)."""
    registry = ToolRegistry.from_config({"tools": [{"class_name": f"own_schema_tools.{cls}",
                                                    "config": {"type": "native"}}]})
    assert registry.names == ["own"] and registry.schemas()[0]["function"]["name"] == "own"


@pytest.mark.usefixtures("own_schema_tools")
@pytest.mark.parametrize("cls, message", [
    ("NoSchemaTool", r"building own_schema_tools\.NoSchemaTool without one failed \(ToolSchemaError"),
    ("DuckTool", r"own_schema_tools\.DuckTool provides none"),
])
def test_an_entry_without_tool_schema_whose_class_has_none_is_refused(cls, message):
    """Contract: neither the entry nor the class gives a schema: one message naming the entry, the class and both
    fixes."""
    with pytest.raises(PluginConfigError, match=r"<config>: tools\[0\]: no tool_schema, and " + message) as info:
        ToolRegistry.from_config({"tools": [{"class_name": f"own_schema_tools.{cls}"}]})
    assert "add `tool_schema:" in str(info.value) and "get_openai_tool_schema()" in str(info.value)
