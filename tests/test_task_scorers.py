"""verl's default scorers as polyturn tasks: MATH (hendrycks_math), DAPO math (math_dapo), Search-R1 QA (searchr1_qa).

Contracts: each scorer gives verl v0.9's score on typical answers (boxed, nested braces, fractions, units, DAPO's
`Answer:` line, a wrong answer, no answer) and the same result as verl's own scorer (copied unchanged into
tests/verl_files/v0_9/reward_score/) over a grid of responses and ground truths; every source verl's
`default_compute_score` dispatches is either scored by the task declaring it, with no clash, or refused at launch
naming why and the fix.
"""
from __future__ import annotations

import ast
import importlib.util
import itertools
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

import recipe.tasks
from recipe.config_build import ConfigError
from recipe.preflight import check_data
from recipe.reward import CustomRewardFunctionConfig, RewardConfig, RewardFn
from recipe.tasks import NO_SCORER, scorer_of, scorer_paths, task_modules, verl_aliases
from recipe.tasks import hendrycks_math, math_dapo, searchr1_qa
from rollout.trajectory import Trajectory

pytestmark = pytest.mark.unit

VERL_SCORERS = Path(__file__).parent / "verl_files" / "v0_9" / "reward_score"


def _verl(name: str) -> ModuleType:
    """verl v0.9's scorer module `name`, loaded from its unchanged copy (it imports only the standard library)."""
    spec = importlib.util.spec_from_file_location(f"verl_v0_9_{name}", VERL_SCORERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_math_scores_boxed_answers_as_verl():
    """Contract: the last \\boxed{} counts (nested braces kept); \\dfrac == \\frac, \\frac12 == \\frac{1}{2},
    0.5 == 1/2 == \\frac{1}{2} (but 0.25 != \\frac{1}{4}); units, degrees and `x =` are dropped; a wrong answer, an
    unboxed one, an \\fbox and no answer score 0.0."""
    score = hendrycks_math.compute_score
    assert score("First \\boxed{3}, then finally \\boxed{\\frac{\\sqrt{3}}{2}}.", "\\frac{\\sqrt{3}}{2}") == 1.0
    assert score("so \\boxed{\\dfrac{1}{2}}", "\\frac12") == 1.0
    assert score("so \\boxed{0.5}", "\\frac{1}{2}") == 1.0 and score("\\boxed{1/2}", "\\tfrac{1}{2}") == 1.0
    assert score("so \\boxed{.5}", "\\frac{1}{2}") == 1.0
    assert score("so \\boxed{0.25}", "\\frac{1}{4}") == 0.0  # only 0.5 has a decimal twin in verl's rule
    assert score("\\boxed{-3/4}", "\\frac{-3}{4}") == 1.0
    assert score("\\boxed{01/2}", "\\frac{01}{2}") == 0.0  # a/b becomes a fraction only for plain integers
    assert score("\\boxed{5\\text{ cm}}", "5") == 1.0 and score("\\boxed{90^\\circ}", "90") == 1.0
    assert score("\\boxed{x = 7}", "7") == 1.0 and score("\\boxed{\\left( 1, 2 \\right)}", "(1,2)") == 1.0
    assert score("The answer is $\\boxed 42$.", "42") == 1.0  # `\boxed ` with a space, up to the `$`
    assert score("\\boxed{41}", "42") == 0.0 and score("the answer is 42", "42") == 0.0
    assert score("\\fbox{42}", "42") == 0.0 and score("\\boxed{42", "42") == 0.0
    assert score("\\boxed{42}", None) == 0.0 and score("", "42") == 0.0
    assert score("\\boxed{\\sqrt}", "\\sqrt") == 1.0  # no canonical form: compared as written


def test_dapo_reads_the_answer_line_and_scores_plus_minus_one():
    """Contract: verl's DAPO result dict: the last `Answer:` line (any case) in the last 300 characters, normalized
    (units, `$`, \\text{}, thousands commas), 1.0 / -1.0 with acc and pred; no answer is -1.0 with pred [INVALID];
    strict_box_verify compares the last boxed answer of the final 100 characters as written."""
    score = math_dapo.compute_score
    assert score("Some work.\nAnswer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert score("answer : $1,000$ dollars", "1000")["score"] == 1.0
    assert score("Answer: \\dfrac{1}{2}", "\\frac{1}{2}")["score"] == -1.0  # DAPO does not map \dfrac
    assert score("Answer: \\frac12", "\\frac{1}{2}")["score"] == 1.0
    assert score("Answer: x = 30^\\circ", "30")["acc"] is True
    assert score("Answer: 41", "42") == {"score": -1.0, "acc": False, "pred": "41"}
    assert score("I give up.", "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert score("Answer: 42" + "." * 300, "42")["score"] == -1.0  # before the last 300 characters
    assert score("Answer: 42\n" + "." * 280, "42")["score"] == 1.0  # inside them
    assert score("so \\boxed{42}", "42", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "42"}
    assert score("so \\boxed{42}" + " " * 80, "42", strict_box_verify=True)["acc"] is True
    assert score("so \\boxed{42}" + " " * 100, "42", strict_box_verify=True)["pred"] is None
    with pytest.raises(ValueError, match="pause_tokens_index"):
        score("\\boxed{1}", "1", strict_box_verify=True, pause_tokens_index=[3])


def test_search_r1_exact_match():
    """Contract: the last <answer> is matched SQuAD-normalized against any target; a miss scores format_score, no
    answer 0.0, more than 10 answer tags a quarter; a plain-text ground truth is its own target."""
    score = searchr1_qa.compute_score
    truth = {"target": ["Eiffel Tower", "La tour Eiffel"]}
    assert score("<answer>Paris</answer> no, <answer> the Eiffel  tower! </answer>", truth) == 1.0
    assert score("<answer>\nla tour eiffel\n</answer>", truth) == 1.0
    assert score("<answer>Louvre</answer>", truth) == 0.0 and score("<answer>Louvre</answer>", truth, 0.1) == 0.1
    assert score("The Eiffel Tower", truth) == 0.0
    assert score("<answer>x</answer>" * 10 + "<answer>Eiffel Tower</answer>", truth) == 0.25
    assert score("<answer>Eiffel Tower</answer>", "eiffel tower") == 1.0


def _grid() -> list[tuple[str, str]]:
    """(response, ground truth) pairs covering the rules' corners."""
    answers = ["42", "41", "0.5", ".5", "1/2", "\\frac12", "\\dfrac{1}{2}", "\\frac{1}{2}", "\\frac1", "\\sqrt3",
               "\\sqrt{3}", "x = 5", "5\\text{ cm}", "5 \\text{ cm} \\text{ m}", "90^\\circ", "1,000", "\\$1,000",
               "\\left(1,2\\right)", "\\text{(A)}", "\\frac{\\sqrt{3}}{2}", "-1/2", "-0/2", "01/2", "", "a=b=c",
               "50\\%"]
    wrappers = ["\\boxed{{{}}}", "The answer is $\\boxed {}$.", "\\fbox{{{}}}", "Answer: {}", "answer : ${}$",
                "<answer>{}</answer>", "{}", "\\boxed{{{}", "Answer: \\boxed{{{}}}"]
    truths = ["42", "\\frac{1}{2}", "5", "1000", "\\sqrt{3}", "(1,2)", "90", "\\frac{\\sqrt{3}}{2}", "-\\frac{1}{2}",
              "\\frac{01}{2}", "\\frac{-0}{2}"]
    return [(w.format(a), t) for w, a, t in itertools.product(wrappers, answers, truths)]


def test_same_results_as_verls_scorers_on_a_grid():
    """Contract: over every (response, ground truth) of the grid, each scorer returns what verl v0.9's returns
    (MATH's 1.0/0.0, DAPO's dict in both modes, Search-R1's score as verl's default_compute_score makes it a float)."""
    verl_math, verl_dapo, verl_search = _verl("math_reward"), _verl("math_dapo"), _verl("search_r1_like_qa_em")
    for response, truth in _grid():
        where = f"{response!r} vs {truth!r}"
        assert hendrycks_math.compute_score(response, truth) == verl_math.compute_score(response, truth), where
        assert math_dapo.compute_score(response, truth) == verl_dapo.compute_score(response, truth), where
        strict = math_dapo.compute_score(response, truth, strict_box_verify=True)
        assert strict == verl_dapo.compute_score(response, truth, strict_box_verify=True), where
        target = {"target": [truth, "Eiffel Tower"]}
        assert searchr1_qa.compute_score(response, target) == float(verl_search.compute_score(response, target)), where


def _verl_dispatch() -> tuple[set[str], set[str]]:
    """(exact data sources, prefixes) verl v0.9's `default_compute_score` dispatches, read from its source."""
    tree = ast.parse((VERL_SCORERS / "__init__.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "default_compute_score")
    exact, prefixes = set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "data_source":
            for c in node.comparators:
                exact |= {e.value for e in (c.elts if isinstance(c, ast.List) else [c]) if isinstance(e, ast.Constant)}
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "startswith":
            prefixes.add(node.args[0].value)
    return exact, prefixes


def test_every_verl_source_is_scored_or_refused_with_a_reason():
    """Contract: each source verl's default_compute_score dispatches is found by `scorer_paths()` (by its own entry
    or a prefix) or listed in NO_SCORER with a reason; sources starting with "aime" go to DAPO as in verl."""
    exact, prefixes = _verl_dispatch()
    assert len(exact) >= 25 and prefixes == {"aime"}, (exact, prefixes)
    paths = scorer_paths()
    refused = {s for group in NO_SCORER for s in group}
    assert not refused & {s for s in exact if scorer_of(s, paths)}, "a source is both scored and refused"
    assert {s for s in exact if scorer_of(s, paths) is None} == refused
    for source in ("aime", "aime2024", "aime_2025", "aime25"):
        assert scorer_of(source, paths) == "recipe.tasks.math_dapo.compute_score"
    assert scorer_of("MATH", paths) is None and scorer_of("ai", paths) is None


def test_every_declared_source_is_found_with_no_clash(tmp_path, monkeypatch):
    """Contract: every task's DATA_SOURCES entry maps to that task's scorer, and its verl aliases are served; a task
    declaring a source another declares, or one a prefix covers, is refused naming both."""
    paths = scorer_paths()
    declared = 0
    for module in task_modules():
        for source in getattr(module, "DATA_SOURCES", ()):
            assert scorer_of(source, paths) == f"{module.__name__}.compute_score", source
            declared += 1
        for verl_path, ours in getattr(module, "VERL_ALIASES", {}).items():
            assert verl_aliases()[verl_path] == ours
    assert declared == len([k for k in paths if not k.endswith("*")]) >= 15
    for clash in ('DATA_SOURCES = ("aime_2030",)', 'DATA_SOURCES = ("math",)', 'DATA_SOURCE_PREFIXES = ("aim",)',
                  'DATA_SOURCE_PREFIXES = ("searchR1_",)'):
        (tmp_path / "zz_clash.py").write_text(f"{clash}\n")
        monkeypatch.setattr(recipe.tasks, "__path__", [*recipe.tasks.__path__, str(tmp_path)])
        monkeypatch.delitem(__import__("sys").modules, "recipe.tasks.zz_clash", raising=False)
        with pytest.raises(ValueError, match="zz_clash.compute_score overlaps .* of recipe.tasks"):
            scorer_paths()


def test_sources_without_a_scorer_are_refused_at_launch_naming_why():
    """Contract: the launch check refuses verl's sandbox, PRIME and geo3k sources with one line per kind saying
    polyturn has no scorer, why, and custom_reward_function.path; an unknown source gets the known list; none of
    this when custom_reward_function.path is set."""
    cfg = SimpleNamespace(data=SimpleNamespace(train_batch_size=1), custom_reward_function=SimpleNamespace(path=None))
    sources = {"codecontests", "taco", "numina_olympiads", "hiyouga/geometry3k", "my/benchmark", "aime24",
               "HuggingFaceH4/MATH-500"}
    with pytest.raises(ConfigError) as err:
        check_data(cfg, 8, sources)
    lines = err.value.problems
    assert len(lines) == 4, lines
    assert lines[0].startswith("data_source ['codecontests', 'taco'] in data.train_files / data.val_files: polyturn "
                               "has no scorer for these (verl runs the response's code on the row's test cases")
    assert "PRIME" in lines[1] and "mathruler" in lines[2] and "known: ['DigitalLearningGmbH" in lines[3]
    assert all("custom_reward_function.path=<file.py>" in line for line in lines)
    check_data(cfg, 8, {"aime24", "HuggingFaceH4/MATH-500", "searchR1_nq", "math"})  # all scored: no refusal
    cfg.custom_reward_function.path = "reward.py"
    check_data(cfg, 8, sources)


def _traj(source: str, text: str, truth: object) -> Trajectory:
    t = Trajectory(uid="p/0", prompt_uid="p", sample_index=0, prompt_ids=[1, 2], data_source=source,
                   ground_truth=truth, extra_info={})
    t.messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
    return t


def test_the_reward_function_scores_rows_of_verls_sources():
    """Contract: the outcome reward picks these scorers by data_source (a prefix too), DAPO's acc becomes an extra
    metric, and a source without a scorer raises the launch check's line."""
    fn = RewardFn(RewardConfig(), CustomRewardFunctionConfig())
    assert fn.outcome(_traj("DigitalLearningGmbH/MATH-lighteval", "\\boxed{\\dfrac12}", "\\frac{1}{2}")) == (1.0, {})
    assert fn.outcome(_traj("aime_2025", "Answer: 7", "8")) == (-1.0, {"acc": 0.0})
    assert fn.outcome(_traj("searchR1_nq", "<answer>Paris</answer>", {"target": ["paris"]})) == (1.0, {})
    with pytest.raises(ValueError, match=r"data_source \['apps'\] of a trajectory: polyturn has no scorer"):
        fn.outcome(_traj("apps", "print(1)", "{}"))
