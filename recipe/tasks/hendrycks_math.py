"""MATH (Hendrycks et al.) competition problems: the scorer verl's default uses for its MATH data sources.

Rows come from verl's `examples/data_preprocess/math_dataset.py` (data_source
"DigitalLearningGmbH/MATH-lighteval", ground truth the boxed answer of the reference solution), or
from the older "lighteval/MATH" and the MATH-500 test set. No preprocessing lives here.

Scoring (`compute_score`) is verl's `reward_score.math_reward` rule, which is lm-evaluation-harness's
MATH rule: the answer is the last `\\boxed{...}` of the response (braces matched, so nested ones
stay in), or, when the text has `\\boxed ` (a space), what follows the last `\\boxed ` up to a `$`.
Answer and ground truth are then brought to one written form (`canonical`): no spaces, newlines,
`\\left`/`\\right`, `\\!`, degree marks, `\\$` or `\\%`; `\\dfrac`/`\\tfrac` -> `\\frac`; units after
`\\text{ ` dropped; `\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}`; `.5` -> `0.5`; a short
`x = ` in front dropped; `0.5` and `1/2` (plain integers over plain integers) -> `\\frac{1}{2}`.
They score 1.0 when those forms are equal, else 0.0. Only `0.5` has a decimal twin: `0.25` is not
`\\frac{1}{4}` here, as in verl.

verl's quirks kept, since they decide rewards: an answer in `\\fbox{...}` scores 0 (verl finds it, then
refuses it); a text that cannot be brought to the form (a `\\sqrt` or `\\frac` with nothing after it,
two `\\text{ ` units) is compared as written; no answer scores 0.0.
"""
from __future__ import annotations

import re

DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
"""verl's MATH data sources (v0.9 `default_compute_score`)."""
VERL_ALIASES = {
    "verl.utils.reward_score.math_reward.compute_score": f"{__name__}.compute_score",
    "verl.utils.reward_score.math.compute_score": f"{__name__}.compute_score",  # its name before verl 0.6
}
"""verl's MATH scorer, under its current and its former module name."""

_PLAIN_INT = re.compile(r"-?[1-9][0-9]*|0")
# (old, new) replacements applied in this order before the unit, leading-zero and `x =` rules
_CLEANUP = (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
            ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))


class _NoForm(Exception):
    """The text cannot be brought to the canonical form; it is compared as written."""


def last_boxed(text: str) -> str | None:
    """The answer of `text` (see the module docstring); None when there is none or it is not a `\\boxed{}`."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:  # verl then looks for `\\fbox{...}`, and scores what it finds 0: as no answer
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            boxed = text[start:i + 1]
            return boxed[len("\\boxed{"):-1] if boxed.startswith("\\boxed{") else None
    return None


def _braced_sqrt(text: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}` (one character taken as the argument)."""
    head, *parts = text.split("\\sqrt")
    for part in parts:
        if not part:
            raise _NoForm(text)
        head += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return head


def _braced_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{7}` -> `\\frac{1}{7}`; the text unchanged when a `\\frac` has fewer
    than two characters after it."""
    head, *parts = text.split("\\frac")
    for part in parts:
        if not part:
            raise _NoForm(text)
        if part[0] == "{":
            head += "\\frac" + part
        elif len(part) < 2:
            return text
        elif part[1] == "{":
            head += "\\frac{" + part[0] + "}" + part[1:]
        else:
            head += "\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:]
    return head


def canonical(text: str) -> str:
    """The written form MATH answers are compared in (see the module docstring); raises _NoForm."""
    for old, new in _CLEANUP:
        text = text.replace(old, new)
    if "\\text{ " in text:  # units on the right
        value, *units = text.split("\\text{ ")
        if len(units) != 1:
            raise _NoForm(text)
        text = value
    text = text.replace("\\\\%", "").replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    lhs, eq, rhs = text.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:
        text = rhs
    text = _braced_fracs(_braced_sqrt(text).replace(" ", ""))
    if text == "0.5":
        return "\\frac{1}{2}"
    num, slash, den = text.partition("/")
    if slash and _PLAIN_INT.fullmatch(num) and _PLAIN_INT.fullmatch(den):
        return f"\\frac{{{num}}}{{{den}}}"
    return text


def is_equiv(answer: str, ground_truth: object) -> bool:
    """Whether `answer` equals `ground_truth` in the canonical form (as written when either has none)."""
    if not isinstance(ground_truth, str):
        return False
    try:
        return canonical(answer) == canonical(ground_truth)
    except _NoForm:
        return answer == ground_truth


def compute_score(solution_str: str, ground_truth: object) -> float:
    """1.0 when the last boxed answer of `solution_str` equals `ground_truth` (see the module docstring), else 0.0."""
    answer = last_boxed(solution_str)
    return 1.0 if answer is not None and is_equiv(answer, ground_truth) else 0.0
