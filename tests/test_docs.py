"""The documentation stays true: README.md, CHANGELOG.md and docs/**/*.md are checked without a site generator.

Contract: every relative link resolves to a file or folder of the repository, and every `#anchor` to a heading of the
page it names (GitHub's heading ids); every repository path written in backticks (`recipe/...`, `tests/...`) exists;
every `python -m X` names a module that `python -m` can run (found with `importlib.util.find_spec`, nothing run);
and the generated reference pages equal what `recipe.docs_reference` writes now (`UPDATE_DOCS=1` rewrites them).
No external link is fetched (no network). Fenced code blocks are skipped for links, anchors and paths (they hold
commands and placeholders), not for `python -m`.
"""
from __future__ import annotations

import importlib.util
import os
import re
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").rglob("*.md")])
REPO_DIRS = ("recipe", "rollout", "megatron_workers", "cpu_standins", "scripts", "tests", "docs", "benchmarks",
             "tool_configs", ".ci")
"""A backticked path whose first part is one of these, ending in a file extension or `/`, must exist (metric names
such as `rollout/tool/calls` have neither)."""
FOREIGN_MODULES = ("verl",)
"""`python -m` modules the docs quote from other projects (verl's own commands, for comparison)."""

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
MODULE = re.compile(r"python -m ([A-Za-z_][\w.]*\w)(?![\w.<])")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
PATHLIKE = re.compile(r"[\w.-]+(/[\w.-]*)+(\.\w+|/)")  # a file (with an extension) or a folder (a trailing /)


def anchors(text: str) -> set[str]:
    """GitHub's ids of the headings of markdown `text`: lower case, punctuation dropped, spaces to hyphens, `-1`,
    `-2` ... after repeats."""
    seen: Counter[str] = Counter()
    out = set()
    for title in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return out


def runnable(module: str) -> bool:
    """`python -m module` would find something to run: a module, or a package with a `__main__`."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    return spec.submodule_search_locations is None or importlib.util.find_spec(f"{module}.__main__") is not None


def problems(page: Path, repo: Path = REPO) -> list[str]:
    """What is wrong in markdown file `page`, one line each (empty: nothing)."""
    text = page.read_text()
    prose = FENCE.sub("", text)
    where = page.relative_to(repo) if page.is_relative_to(repo) else page
    found = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked (no network)
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            found.append(f"{where}: link to {target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
            found.append(f"{where}: link to {target}: no heading #{anchor} there")
    for span in CODE.findall(prose):
        path = span.split("::")[0]
        if PATHLIKE.fullmatch(path) and path.split("/")[0] in REPO_DIRS and not (repo / path).exists():
            found.append(f"{where}: `{span}`: no such path in the repository")
    for module in MODULE.findall(text):
        if module.split(".")[0] not in FOREIGN_MODULES and not runnable(module):
            found.append(f"{where}: python -m {module}: no such module to run")
    return found


def test_pages_are_found():
    """The page list holds the README and the docs pages (an empty glob cannot pass silently)."""
    names = {str(p.relative_to(REPO)) for p in PAGES}
    assert {"README.md", "docs/index.md", "docs/reference/config.md", "docs/reference/launch-errors.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_anchors_paths_and_modules_resolve(page: Path):
    """Contract: every relative link, anchor, backticked repository path and `python -m` module of the page exists."""
    assert not problems(page), "\n".join(problems(page))


def test_the_checks_can_fail(tmp_path: Path):
    """Contract: a broken link, a missing anchor, a missing repository path and an unknown module are each found."""
    (tmp_path / "other.md").write_text("# A heading\n\n```\n# not a heading\n```\n")
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "config_build.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading) [gone](nowhere.md) [bad](other.md#not-a-heading) [web](https://x.y/z)\n"
                    "`recipe/no_such_module.py` `recipe/config_build.py` `some/other/path.py` `rollout/tool/calls`\n"
                    "python -m recipe.no_such_module and python -m recipe.config_build and python -m verl.trainer\n"
                    "```bash\n[in code](nowhere.md) `recipe/not_checked_here.py`\n```\n")
    found = problems(page, tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == [
        "link to nowhere.md: no such file",
        "link to other.md#not-a-heading: no heading #not-a-heading there",
        "`recipe/no_such_module.py`: no such path in the repository",
        "python -m recipe.no_such_module: no such module to run",
    ], found


def test_anchors_follow_github():
    """GitHub's heading ids: punctuation and backticks dropped, spaces to hyphens, repeats numbered."""
    text = "# SFT keys (`python -m recipe.main_sft`)\n## verl's fully async trainer\n## Step\n## Step\n"
    assert anchors(text) == {"sft-keys-python--m-recipemain_sft", "verls-fully-async-trainer", "step", "step-1"}


def test_generated_reference_pages_are_fresh():
    """Contract: docs/reference/config.md and cli.md are what `python -m recipe.docs_reference` writes from the code
    now (every config key with its docstring, every verl key rule, every CLI flag); UPDATE_DOCS=1 rewrites them."""
    from recipe.docs_reference import pages

    stale = []
    for path, text in pages().items():
        if os.environ.get("UPDATE_DOCS") == "1":
            path.write_text(text)
        elif not path.is_file() or path.read_text() != text:
            stale.append(str(path.relative_to(REPO)))
    assert not stale, f"stale generated pages {stale}: UPDATE_DOCS=1 pytest tests/test_docs.py -k fresh"


def test_config_reference_covers_every_key():
    """Every RL and SFT leaf key of the schemas and every verl key rule has a row in docs/reference/config.md."""
    from recipe.config_build import flat_keys
    from recipe.config_schema import PPOConfig
    from recipe.sft_config import SFTConfig
    from recipe.verl_keys import VERL_KEYS

    text = (REPO / "docs" / "reference" / "config.md").read_text()
    rl, sft = text.split("## SFT keys", 1)
    sft, verl = sft.split("## verl keys", 1)
    for part, keys in ((rl, flat_keys(PPOConfig)), (sft, flat_keys(SFTConfig)), (verl, VERL_KEYS)):
        missing = [k for k in keys if f"| `{k}` |" not in part]
        assert not missing, missing
